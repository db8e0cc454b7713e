"""InDIGO (model type ``indigo``) in the common training script.

    flexformers-train --model_type indigo --preset transformer_iwslt_de_en --task word_order \\
        --order l2r --indigo_encoder_positions false --output_dir runs/indigo-l2r
    flexformers-train --model_type indigo --task word_order --order sao --sao_bootstrap_steps 6000 ...
    flexformers-train --model_type indigo --order sao --model_name_or_path runs/indigo-l2r ...   # bootstrapped

- :class:`InDIGOArguments`: the generation order used for training (Table 1's pre-defined orders or ``sao``), the
  SAO search settings (Sec. 4.2) and the encoder-position switch for word order recovery.
- :class:`SAOBootstrapCallback`: trains with L2R for ``--sao_bootstrap_steps`` optimisation steps, then with
  searched orders (the paper bootstraps from a model pre-trained 6,000 steps in L2R).
- :class:`InDIGOSeq2SeqTrainer`: computes the CF/RF frequency cutoff from the training targets and logs the
  word and position losses separately.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import Seq2SeqTrainer, TrainerCallback

from flexformers.configuration.configuration_indigo import InDIGOConfig
from flexformers.modeling.indigo_insertion import SAO_ORDER_WEIGHTINGS
from flexformers.modeling.modeling_indigo import InDIGOForConditionalGeneration
from flexformers.training_scripts.indigo_orders import (
    ALL_ORDERS,
    InDIGODataCollator,
    common_token_ids_by_frequency,
    load_spacy_pipeline,
)
from flexformers.training_scripts.model_registry import MethodSpec, load_initial_checkpoint


@dataclass
class InDIGOArguments:
    order: str = field(
        default="l2r",
        metadata={"help": f"Training generation order: one of {', '.join(ALL_ORDERS)} (Table 1; 'sao' = searched adaptive order, Sec. 4.2)."},
    )
    sao_beam_size: int = field(default=8, metadata={"help": "SAO: beam width B of the permutation search (paper: 8)."})
    sao_bootstrap_steps: int = field(
        default=0,
        metadata={"help": "SAO: optimisation steps trained with L2R before searching orders (paper: 6000; 0 = search "
                  "from the first step, e.g. when --model_name_or_path is an L2R-trained InDIGO)."},
    )
    sao_search_dropout: bool = field(
        default=True, metadata={"help": "SAO: keep dropout on during the search (the paper's noise)."}
    )
    sao_cuda_graphs: bool = field(
        default=False,
        metadata={"help": "SAO: on a GPU, replay the search as CUDA graphs, one per batch shape (H100, batch 32: the "
                  "SAO step 7.3x -> 2.6x an L2R step); a shape is captured at its second batch, so it pays when "
                  "batches come in few shapes."},
    )
    sao_train_orders: int | None = field(
        default=None,
        metadata={"help": "SAO: train on the best k of the B found orders (default: all B, Eq. 12)."},
    )
    sao_order_weighting: str = field(
        default="uniform",
        metadata={"help": "SAO: 'uniform' over the found orders (Eq. 12) or 'posterior' (q proportional to p(y_pi|x) on the beam)."},
    )
    indigo_encoder_positions: bool | None = field(
        default=None,
        metadata={"help": "Absolute positions in the encoder; false for word order recovery (a bag of words)."},
    )
    spacy_model: str = field(default="en_core_web_sm", metadata={"help": "spaCy pipeline of the 'syn' order."})
    order_seed: int = field(default=0, metadata={"help": "Seed of the 'rnd' order's permutations."})

    def __post_init__(self):
        if self.order not in ALL_ORDERS:
            raise ValueError(f"--order must be one of {', '.join(ALL_ORDERS)}, got {self.order!r}")
        if self.sao_beam_size < 1:
            raise ValueError(f"--sao_beam_size must be >= 1, got {self.sao_beam_size}")
        if self.sao_bootstrap_steps < 0:
            raise ValueError(f"--sao_bootstrap_steps must be >= 0, got {self.sao_bootstrap_steps}")
        if self.sao_order_weighting not in SAO_ORDER_WEIGHTINGS:
            raise ValueError(f"--sao_order_weighting must be one of {SAO_ORDER_WEIGHTINGS}, got {self.sao_order_weighting!r}")
        if self.sao_train_orders is not None and not 1 <= self.sao_train_orders <= self.sao_beam_size:
            raise ValueError(f"--sao_train_orders must be in [1, --sao_beam_size], got {self.sao_train_orders}")


def update_indigo_config(config: InDIGOConfig, method_args: InDIGOArguments | None) -> InDIGOConfig:
    if method_args is not None and method_args.indigo_encoder_positions is not None:
        config.encoder_use_positions = method_args.indigo_encoder_positions
        if not config.encoder_use_positions:
            config.encoder_learned_pos = False
        config.validate_fields()
    return config


def build_indigo_model(model_args, method_args, config, tokenizer):
    """A fresh model, or ``--model_name_or_path`` (e.g. an L2R-trained InDIGO to bootstrap SAO from), with the SAO
    settings attached."""
    checkpoint = getattr(model_args, "model_name_or_path", None)
    model = (load_initial_checkpoint(InDIGOForConditionalGeneration, model_args, config) if checkpoint
             else InDIGOForConditionalGeneration(config))
    if method_args is not None:
        model.sao_beam_size = method_args.sao_beam_size
        model.sao_search_dropout = method_args.sao_search_dropout
        model.sao_search_cuda_graphs = method_args.sao_cuda_graphs
        model.sao_train_orders = method_args.sao_train_orders
        model.sao_order_weighting = method_args.sao_order_weighting
        model.use_searched_orders = method_args.order == "sao" and method_args.sao_bootstrap_steps == 0
    return model


def make_indigo_collator(tokenizer, model, method_args):
    method_args = method_args or InDIGOArguments()
    config = model.config
    return InDIGODataCollator(
        order=method_args.order,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        eod_token_id=config.eod_token_id,
        # CF/RF: the cutoff is computed from the training targets by InDIGOSeq2SeqTrainer.
        common_token_ids=set() if method_args.order in ("cf", "rf") else None,
        tokenizer=tokenizer,
        spacy_nlp=load_spacy_pipeline(method_args.spacy_model) if method_args.order == "syn" else None,
        seed=method_args.order_seed,
    )


class SAOBootstrapCallback(TrainerCallback):
    """Switch the model from the L2R order to searched orders after ``bootstrap_steps`` optimisation steps."""

    def __init__(self, bootstrap_steps: int):
        self.bootstrap_steps = bootstrap_steps

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if model is not None:
            model.use_searched_orders = state.global_step >= self.bootstrap_steps


def make_indigo_callbacks(method_args) -> list:
    if method_args is not None and method_args.order == "sao":
        return [SAOBootstrapCallback(method_args.sao_bootstrap_steps)]
    return []


class InDIGOSeq2SeqTrainer(Seq2SeqTrainer):
    """Seq2SeqTrainer that fills the CF/RF frequency cutoff from the training targets (Sec. 5.1: common and rare
    halves of about equal size) and logs the word and position losses (Eq. 10) next to the total."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        collator = self.data_collator
        if isinstance(collator, InDIGODataCollator) and collator.order in ("cf", "rf") and not collator.common_token_ids:
            if self.train_dataset is None:
                raise ValueError("--order cf/rf needs a training set to compute the frequency cutoff")
            special = {collator.bos_token_id, collator.eos_token_id, collator.eod_token_id, collator.pad_token_id}
            collator.common_token_ids = common_token_ids_by_frequency(self.train_dataset["labels"], exclude=special)
        self._indigo_loss_sums = {"word_loss": 0.0, "position_loss": 0.0, "count": 0}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        if model.training and getattr(outputs, "word_loss", None) is not None:
            self._indigo_loss_sums["word_loss"] += float(outputs.word_loss.detach())
            self._indigo_loss_sums["position_loss"] += float(outputs.position_loss.detach())
            self._indigo_loss_sums["count"] += 1
        return (loss, outputs) if return_outputs else loss

    def log(self, logs, *args, **kwargs):
        count = self._indigo_loss_sums["count"]
        if count and "loss" in logs:
            logs["word_loss"] = round(self._indigo_loss_sums["word_loss"] / count, 4)
            logs["position_loss"] = round(self._indigo_loss_sums["position_loss"] / count, 4)
            self._indigo_loss_sums = {"word_loss": 0.0, "position_loss": 0.0, "count": 0}
        super().log(logs, *args, **kwargs)


SPEC = MethodSpec(
    model_type="indigo",
    config_class=InDIGOConfig,
    model_class=InDIGOForConditionalGeneration,
    arguments_class=InDIGOArguments,
    build_model=build_indigo_model,
    data_collator=make_indigo_collator,
    callbacks=make_indigo_callbacks,
    trainer_class=InDIGOSeq2SeqTrainer,
    update_config=update_indigo_config,
    description="InDIGO insertion Transformer (relative positions, pointer), pre-defined orders or SAO",
)
