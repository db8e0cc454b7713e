"""FLOPs per output token of a Depth-Adaptive decoder (Elbayad et al., ICLR 2020, Appendix B, Table 4)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FLOPS_MECHANISMS = ("full", "fixed", "sequence", "token_multinomial", "token_geometric", "confidence")


@dataclass(frozen=True)
class DecoderFlopsShape:
    """The quantities of Appendix B, Table 4: d_d, d_e, d_f, V and the number of blocks N."""

    decoder_embed_dim: int
    encoder_embed_dim: int
    ffn_dim: int
    vocab_size: int
    num_blocks: int

    @classmethod
    def from_config(cls, config) -> "DecoderFlopsShape":
        return cls(
            decoder_embed_dim=config.decoder_embed_dim,
            encoder_embed_dim=config.encoder_embed_dim,
            ffn_dim=config.decoder_ffn_embed_dim,
            vocab_size=config.decoder_vocab_size,
            num_blocks=config.decoder_layers,
        )


def block_flops(shape: DecoderFlopsShape, source_length: int, t: int, first_call: bool) -> int:
    """FC(x, t) = 12 d_d² + 4 d_f d_d + 4 t d_d + 4|x| d_d + 4 [FirstCall] |x| d_d d_e (Appendix B): a block the
    token goes through at time-step t ≥ 1; the source keys/values are projected on the block's first call."""
    d, e = shape.decoder_embed_dim, shape.encoder_embed_dim
    flops = 12 * d * d + 4 * shape.ffn_dim * d + 4 * t * d + 4 * source_length * d
    if first_call:
        flops += 4 * source_length * d * e
    return flops


def skipped_block_flops(shape: DecoderFlopsShape) -> int:
    """FS = 4 d_d² (Appendix B): a skipped block still projects the copied state to its self-attention keys/values."""
    return 4 * shape.decoder_embed_dim**2


def exit_prediction_flops(shape: DecoderFlopsShape, mechanism: str, t: int, exit_block: int) -> int:
    """FP(t, q(t)) of Appendix B: ``sequence`` 2[t = 1] N d_d, ``token_multinomial`` 2 N d_d, ``token_geometric``
    2 d_d q(t), ``confidence`` 2 q(t) V d_d; ``full``/``fixed`` exits need no prediction (0)."""
    d, n_blocks = shape.decoder_embed_dim, shape.num_blocks
    if mechanism in ("full", "fixed"):
        return 0
    if mechanism == "sequence":
        return 2 * n_blocks * d if t == 1 else 0
    if mechanism == "token_multinomial":
        return 2 * n_blocks * d
    if mechanism == "token_geometric":
        return 2 * d * exit_block
    if mechanism == "confidence":
        return 2 * exit_block * shape.vocab_size * d
    raise ValueError(f"FLOPs mechanism must be one of {FLOPS_MECHANISMS}, got {mechanism!r}")


def sequence_flops(shape: DecoderFlopsShape, exits: Sequence[int], source_length: int, mechanism: str) -> int:
    """Σ_t [q(t) FC(x, t) + (N − q(t)) FS + FP(t, q(t)) + 2 V d_d] for one hypothesis with per-token exits q(t)
    (Appendix B, "Adaptive depth"; with q(t) = N and FP = 0 it is the "Baseline" formula). Confidence thresholding
    already pays for its output projections in FP, so the final 2 V d_d is not added there."""
    n_blocks = shape.num_blocks
    called = [False] * (n_blocks + 1)
    total = 0
    for t, exit_block in enumerate(exits, start=1):
        exit_block = int(exit_block)
        if not 1 <= exit_block <= n_blocks:
            raise ValueError(f"exit {exit_block} at time-step {t} is outside 1..{n_blocks}")
        for block in range(1, exit_block + 1):
            total += block_flops(shape, source_length, t, first_call=not called[block])
            called[block] = True
        total += (n_blocks - exit_block) * skipped_block_flops(shape)
        total += exit_prediction_flops(shape, mechanism, t, exit_block)
        if mechanism != "confidence":
            total += 2 * shape.vocab_size * shape.decoder_embed_dim
    return total


def average_flops_per_token(
    shape: DecoderFlopsShape, exits_per_sentence: Sequence[Sequence[int]], source_lengths: Sequence[int], mechanism: str
) -> float:
    """(1 / Σ_i |y^(i)|) Σ_i Σ_t (…) of Appendix B over a set of hypotheses with their per-token exits."""
    if len(exits_per_sentence) != len(source_lengths):
        raise ValueError(f"{len(exits_per_sentence)} exit sequences but {len(source_lengths)} source lengths")
    tokens = sum(len(exits) for exits in exits_per_sentence)
    if tokens == 0:
        raise ValueError("average_flops_per_token needs at least one generated token")
    total = sum(
        sequence_flops(shape, exits, source_length, mechanism)
        for exits, source_length in zip(exits_per_sentence, source_lengths)
    )
    return total / tokens


def average_exit(exits_per_sentence: Sequence[Sequence[int]]) -> float:
    """AE, the average exit per output token (Sec. 4.3)."""
    tokens = [int(e) for exits in exits_per_sentence for e in exits]
    if not tokens:
        raise ValueError("average_exit needs at least one generated token")
    return sum(tokens) / len(tokens)
