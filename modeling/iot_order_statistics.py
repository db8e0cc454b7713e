"""IOT's order statistics for the training logs: which orders the predictors choose, with what probability, the loss
of every order path, L_D, L_S and the temperatures, summed over training forwards until a log line reads them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flexformers.configuration.configuration_iot import IOTConfig


class IOTOrderStatistics:
    """Per-process accumulators of the order statistics, not model state (no buffers: DDP would broadcast rank 0's
    over every rank's and ``.to(dtype)`` would round them), made on the host even while Transformers builds the model
    on the meta device; the first training forward moves them to the model's device."""

    def __init__(self, config: IOTConfig, encoder_predictor: bool, decoder_predictor: bool):
        self.config = config
        self.encoder_predictor = encoder_predictor
        self.decoder_predictor = decoder_predictor
        self.sums = self._zeros()

    def _zeros(self) -> dict[str, torch.Tensor]:
        """Zeroed accumulators, every key present from the start: a compiled training step, which accumulates into
        them, then always meets the same dict and is not recompiled when a log line empties it."""
        num_enc, num_dec = self.config.num_encoder_orders, self.config.num_decoder_orders
        shapes = {
            "steps": (), "path_loss": (num_enc, num_dec), "decoder_usage": (num_dec,), "encoder_usage": (num_enc,),
            "diversity_loss": (), "sharpness_loss": (), "tau": (2,),
        }
        if self.decoder_predictor:
            shapes["decoder_prob"] = (num_dec,)
        if self.encoder_predictor:
            shapes["encoder_prob"] = (num_enc,)
        return {name: torch.zeros(shape, dtype=torch.float32, device="cpu") for name, shape in shapes.items()}

    @torch.no_grad()
    def accumulate(
        self, path_token_losses, encoder_probs, decoder_probs, encoder_choice, decoder_choice_all,
        diversity, sharpness, tau_e, tau_d,
    ) -> None:
        """Add one training forward's statistics (on the model's device: no copy to the host, a sync on a GPU,
        until they are logged)."""
        stats = self.sums
        num_dec = self.config.num_decoder_orders
        num_enc = self.config.num_encoder_orders

        def add(name, value):
            stats[name] = stats[name].to(value.device) + value.detach().float()

        add("steps", torch.ones((), device=path_token_losses.device))
        add("path_loss", path_token_losses)
        add("decoder_usage", F.one_hot(decoder_choice_all.reshape(-1), num_dec).sum(0))
        add("encoder_usage", F.one_hot(encoder_choice, num_enc).sum(0))
        if decoder_probs is not None:
            add("decoder_prob", decoder_probs.reshape(-1, num_dec).mean(0))
        if encoder_probs is not None:
            add("encoder_prob", encoder_probs.mean(0))
        add("diversity_loss", diversity)
        add("sharpness_loss", sharpness)
        stats["tau"] = torch.stack((tau_e, tau_d)).float()

    def pop(self) -> dict[str, float]:
        """The statistics since the last call as flat ``iot/...`` floats: share of sentences whose argmax decoder
        (encoder) order is each code, mean predictor probability per code, per-token loss of each path, L_D, L_S
        and the temperatures. Resets the accumulators."""
        stats = self.sums
        self.sums = {name: torch.zeros_like(value) for name, value in stats.items()}
        steps = float(stats["steps"])
        if not steps:
            return {}
        out: dict[str, float] = {}
        for side, codes in (("decoder", self.config.decoder_orders), ("encoder", self.config.encoder_orders)):
            usage = stats[f"{side}_usage"]
            usage = usage / usage.sum().clamp(min=1)
            for i, code in enumerate(codes):
                if len(codes) > 1:
                    out[f"iot/{side}_order_{code}_usage"] = float(usage[i])
                if f"{side}_prob" in stats:
                    out[f"iot/{side}_order_{code}_prob"] = float(stats[f"{side}_prob"][i] / steps)
        path_loss = stats["path_loss"] / steps
        for m, enc_code in enumerate(self.config.encoder_orders):
            for n, dec_code in enumerate(self.config.decoder_orders):
                name = f"iot/loss_dec{dec_code}" if len(self.config.encoder_orders) == 1 else (
                    f"iot/loss_enc{enc_code}_dec{dec_code}")
                out[name] = float(path_loss[m, n])
        out["iot/diversity_loss"] = float(stats["diversity_loss"] / steps)
        out["iot/sharpness_loss"] = float(stats["sharpness_loss"] / steps)
        out["iot/tau_encoder"], out["iot/tau_decoder"] = (float(v) for v in stats["tau"])
        return out
