"""The model card of an exported folder: rendered from ``hub_cards/<model_type>.md`` (extending ``_base.md``) with
the checkpoint's architecture, method settings, training arguments and evaluation as ``model-index``."""

from __future__ import annotations

import html
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flexformers.training_scripts.hub_checkpoint import SIGNATURE_FIELDS
from flexformers.training_scripts.hub_remote_code import ExportError

#: Where the card templates live (``hub_cards/<model_type>.md``, extending ``hub_cards/_base.md``).
DEFAULT_CARDS_DIR = Path(__file__).resolve().parent.parent / "hub_cards"


#: Metrics ``flexformers-decode`` writes and how the card names them (others are shown under their key).
METRIC_NAMES = {"bleu": "BLEU", "chrf": "chrF", "ter": "TER", "pov": "PoV (% of outputs that parse as Python)"}


#: The pipeline's ``--task`` values as Hub task types (model-index) and human-readable names.
TASK_TYPES = {"translation": "translation"}


TASK_NAMES = {
    "translation": "Translation",
    "codegen": "Code generation (docstring to Python)",
    "code2doc": "Code documentation (Python to docstring)",
    "word_order": "Word order recovery",
    "files": "Sequence to sequence (parallel files)",
    "hub": "Sequence to sequence (Hub dataset)",
}


#: Generation settings the card does not list (Transformers' bookkeeping, not decoding choices).
CARD_HIDDEN_GENERATION = frozenset(
    {"transformers_version", "_from_model_config", "output_attentions", "output_hidden_states", "use_cache"}
)


#: Config fields shown in the card's hyper-parameter table when the config has them.
CARD_CONFIG_FIELDS = (
    "encoder_layers",
    "decoder_layers",
    "encoder_embed_dim",
    "decoder_embed_dim",
    "encoder_ffn_embed_dim",
    "decoder_ffn_embed_dim",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "encoder_normalize_before",
    "decoder_normalize_before",
    "share_all_embeddings",
    "share_decoder_input_output_embed",
    "dropout",
    "attention_dropout",
    "activation_dropout",
    "label_smoothing",
    "vocab_size",
    "target_vocab_size",
)


#: Baseline fields a method sets to change the architecture (the backbone's seams).
_SEAM_FIELDS = (
    "encoder_use_positions", "decoder_use_positions", "encoder_attention_branches", "decoder_attention_branches",
    "encoder_ffn_branches", "decoder_ffn_branches",
)


_CONFIG_BOOKKEEPING = frozenset(
    {"auto_map", "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "_name_or_path"}
)


def method_specific_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config fields that make this model its method: the fields the baseline config does not have, and the
    backbone's seam switches where they differ from the baseline."""
    from flexformers.configuration.configuration_flexformer import FlexformerConfig

    baseline = FlexformerConfig().to_dict()
    fields = {}
    for key, value in config.items():
        if key in _CONFIG_BOOKKEEPING:
            continue
        if key not in baseline or (key in _SEAM_FIELDS and value != baseline[key]):
            fields[key] = value
    return fields


# ---------------------------------------------------------------------------------------------------------
# Putting text that comes from data (samples, dataset names, config values) into Markdown safely
# ---------------------------------------------------------------------------------------------------------


def _longest_run(text: str, character: str) -> int:
    return max((len(run) for run in re.findall(f"{re.escape(character)}+", text)), default=0)


def markdown_code_span(value: Any, table_cell: bool = False) -> str:
    """``value`` as one inline code span, shown literally whatever it holds: delimited by more backticks than
    any run inside it, on one line, and with ``|`` escaped in a table cell (GFM splits cells on it even in code)."""
    text = " ".join(str(value).splitlines()) if str(value) else " "
    if table_cell:
        text = text.replace("|", "\\|")
    delimiter = "`" * (_longest_run(text, "`") + 1)
    if text.startswith("`") or text.endswith("`"):
        text = f" {text} "
    return f"{delimiter}{text}{delimiter}"


def markdown_text(value: Any) -> str:
    """``value`` as plain inline Markdown text: HTML special characters escaped (no markup can be injected) and
    the characters that would start emphasis, links, code or table cells backslash-escaped; on one line."""
    text = html.escape(" ".join(str(value).splitlines()), quote=False)
    return re.sub(r"([\\`*_\[\]|~#])", r"\\\1", text)


def code_fence(*texts: str) -> str:
    """A ``~`` fence longer than any run of ``~`` in ``texts`` (at least four), so no line of theirs can close the
    block; CommonMark does not render HTML inside a fenced block."""
    return "~" * max(4, max((_longest_run(text, "~") for text in texts), default=0) + 1)


def build_card_data(
    model_name: str,
    eval_results: dict[str, Any] | None,
    *,
    language: Sequence[str] | None = None,
    license: str | None = None,
    model_type: str,
    datasets: Sequence[str] | None = None,
    dataset_config: str | None = None,
):
    """``ModelCardData`` with one ``EvalResult`` per metric of ``eval_results`` (the card's ``model-index``).

    The evaluated dataset is named by its Hub id and config: those a ``--task hub`` run recorded in
    ``eval_results``, else the first of ``datasets`` (export's ``--dataset``) with ``dataset_config``
    (``--dataset_config``), else the corpus name ``flexformers-decode`` gave it (a built-in task or a data file)."""
    from huggingface_hub import EvalResult, ModelCardData

    results = []
    if eval_results is not None:
        dataset_id = eval_results.get("dataset_id") or (datasets[0] if datasets else None)
        config = eval_results.get("dataset_config") or dataset_config
        dataset_name = dataset_id or eval_results["dataset"]
        signatures = {name: eval_results.get(f"{field}_signature") for name, field in SIGNATURE_FIELDS.items()}
        for key, value in eval_results["metrics"].items():
            results.append(
                EvalResult(
                    task_type=TASK_TYPES.get(eval_results["task"], "text2text-generation"),
                    task_name=TASK_NAMES.get(eval_results["task"], eval_results["task"]),
                    dataset_type=dataset_name,
                    dataset_name=f"{dataset_name} ({config})" if config else dataset_name,
                    dataset_config=config,
                    dataset_split=eval_results["split"],
                    metric_type=key,
                    metric_name=METRIC_NAMES.get(key, key),
                    metric_value=round(float(value), 4),
                    metric_config=signatures.get(key) or None,
                )
            )
    return ModelCardData(
        model_name=model_name,
        eval_results=results or None,
        language=list(language) if language else None,
        license=license,
        library_name="transformers",
        pipeline_tag=TASK_TYPES.get(eval_results["task"], "text2text-generation") if eval_results else None,
        tags=["flexformers", model_type, "seq2seq", "custom_code"],
        datasets=list(datasets) if datasets else (
            [eval_results["dataset_id"]] if eval_results and eval_results.get("dataset_id") else None),
        metrics=sorted(eval_results["metrics"]) if eval_results else None,
    )


def render_model_card(
    *,
    model_type: str,
    model_id: str,
    config: dict[str, Any],
    generation_config: dict[str, Any],
    eval_results: dict[str, Any] | None,
    training: dict[str, Any],
    num_parameters: int | None,
    auto_map: dict[str, str],
    source_tokenizer_subfolder: str | None = None,
    training_arguments: dict[str, Any] | None = None,
    samples: Sequence[dict[str, str]] = (),
    method_config: dict[str, Any] | None = None,
    language: Sequence[str] | None = None,
    license: str | None = None,
    datasets: Sequence[str] | None = None,
    dataset_config: str | None = None,
    cards_dir: str | os.PathLike = DEFAULT_CARDS_DIR,
    plugin_module: str | None = None,
    card_template: str | os.PathLike | None = None,
    description: str = "",
) -> str:
    """Render ``hub_cards/<model_type>.md`` (or a method's own ``card_template``, which extends ``_base.md`` too;
    a method from outside the package without one gets the generic ``_plugin.md`` from its ``description``;
    ``plugin_module`` is the module that method's code lives in) and check that the result parses as a model card with a valid
    ``model-index`` (``ModelCard(..., ignore_metadata_errors=False)``). Pure: takes plain dicts.

    Templates put every value that comes from data through a filter: ``| code`` (an inline code span), ``| cell``
    (a code span in a table cell), ``| text`` (escaped inline text), ``| tojson`` inside code, and each sample
    inside its own ``row.fence``; so a test sentence holding a fence or HTML is shown, never rendered."""
    import jinja2
    from huggingface_hub import ModelCard

    cards_dir = Path(cards_dir)
    search_path = [str(cards_dir)]
    template_name = f"{model_type}.md"
    if card_template is not None:
        card_template = Path(card_template)
        if not card_template.is_file():
            raise ExportError(f"the model card template {card_template} of model type {model_type!r} does not exist")
        search_path.insert(0, str(card_template.parent))
        template_name = card_template.name
    elif not (cards_dir / template_name).is_file():
        if plugin_module is None:
            raise ExportError(f"no model card template {cards_dir / template_name} for model type {model_type!r}")
        template_name = "_plugin.md"
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(search_path),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    environment.filters["code"] = markdown_code_span
    environment.filters["cell"] = lambda value: markdown_code_span(value, table_cell=True)
    environment.filters["text"] = markdown_text
    card_data = build_card_data(
        model_id.split("/")[-1],
        eval_results,
        language=language,
        license=license,
        model_type=model_type,
        datasets=datasets,  # Hub dataset ids only; the pipeline's corpus names are not
        dataset_config=dataset_config,
    )
    default_generation = _default_generation_dict()
    content = environment.get_template(template_name).render(
        card_data=card_data.to_yaml(),
        model_id=model_id,
        model_type=model_type,
        config=config,
        hyperparameters={key: config[key] for key in CARD_CONFIG_FIELDS if config.get(key) is not None},
        # the settings a reader needs: those that are not generate()'s own defaults
        generation={key: value for key, value in generation_config.items()
                    if key not in CARD_HIDDEN_GENERATION and default_generation.get(key, object()) != value},
        method_generation={
            key: value
            for key, value in generation_config.items()
            if key not in default_generation and key not in ("transformers_version", "_from_model_config")
        },
        eval=eval_results,
        task_name=TASK_NAMES.get(eval_results["task"], eval_results["task"]) if eval_results else None,
        training_arguments=training_arguments or {},
        method_config=method_config or {},
        samples=[dict(sample, fence=code_fence(*(str(text) for text in sample.values()))) for sample in samples],
        example_input=samples[0]["source"] if samples else None,
        datasets=list(datasets or []),
        metric_names=METRIC_NAMES,
        training=training,
        num_parameters=num_parameters,
        auto_map=auto_map,
        plugin_module=plugin_module,
        description=description,
        source_tokenizer_subfolder=source_tokenizer_subfolder,
    )
    try:
        card = ModelCard(content, ignore_metadata_errors=False)
    except Exception as error:
        raise ExportError(f"the rendered card of {model_type!r} is not a valid model card: {error}") from error
    return str(card)


def _default_generation_dict() -> dict[str, Any]:
    from transformers import GenerationConfig

    return GenerationConfig().to_dict()
