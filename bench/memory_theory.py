"""What the memory benchmark checks against: activation bytes per transformer block, and model
states per rank under DDP and ZeRO.

Activations, Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", section 4): per layer, 16-bit activations, a GPT-3 block (LayerNorm, GELU MLP of 4h,
unfused softmax attention, dropout masks of 1 byte per element): sbh(34 + 5as/h) bytes; with
tensor parallelism t: sbh(10 + 24/t + 5as/(ht)); with sequence parallelism too: sbh(34 + 5as/h)/t;
their selective recomputation (the attention core only) drops the 5as/h term; full recomputation
keeps the layer input, 2sbh (sharded by t under sequence parallelism).

`plait_block` derives the same count for plait's GPT block (`plait.models.gpt.Block`), tensor by
tensor, from what autograd saves there (see its docstring): RMSNorm computes in fp32 and saves that
copy, the MLP is SwiGLU with d_ff hidden units, torch's unfused attention on CPU (the kernel used
when dropout is on) computes in fp32 whatever the input dtype, and CPU dropout saves its scaled
noise in the input's dtype rather than a 1-byte mask. `tests/test_bench_memory.py` checks it
against the measured bytes of a block, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Shape", "korthikanti", "plait_block", "zero_states"]


@dataclass(frozen=True)
class Shape:
    """One block's sizes on one rank: s sequence, b batch, h hidden, a heads, kv KV heads, f MLP
    hidden units, t tensor-parallel ranks, sp sequence parallelism, e activation bytes (2 or 4),
    hd head dim; ``rng`` bytes of the CPU generator state a checkpoint keeps (0 when not counted);
    ``native_dropout``: dropout keeps a 1-byte mask (CUDA) instead of a scaled-noise tensor (CPU)."""

    s: int
    b: int
    h: int
    a: int
    kv: int
    f: int
    t: int = 1
    sp: bool = False
    e: int = 2
    rng: int = 0
    native_dropout: bool = False

    @property
    def hd(self) -> int:
        return self.h // self.a


def korthikanti(x: Shape, policy: str | None) -> float:
    """Korthikanti et al.'s bytes per layer (16-bit activations, whatever ``x.e`` is)."""
    s, b, h, a, t = x.s, x.b, x.h, x.a, x.t
    if policy == "full":
        return 2 * s * b * h / (t if x.sp else 1)
    core = 0.0 if policy == "selective" else 5 * a * s / h  # their selective: the attention core only
    if x.sp:
        return s * b * h * (34 + core) / t
    return s * b * h * (10 + 24 / t + core / t)


def plait_block(x: Shape, policy: str | None) -> list[tuple[str, float]]:
    """Bytes one plait GPT block keeps for backward on one rank, term by term: (what, bytes).

    No checkpointing (t: the tp group; n = t under SP, else 1; m: a dropout mask's bytes per element,
    the input's dtype on CPU, where dropout multiplies by a saved scaled-noise tensor, 1 where
    ``native_dropout`` keeps a bool mask):

    * each of the two RMSNorms: its input cast to fp32 (4 bytes; the input itself when it is fp32),
      saved by ``pow`` and by the product with the reciprocal RMS (s*b fp32, also saved); the
      normalised value cast back (e), saved for the weight's gradient (all sharded by n); and its
      output, the input of the region's first matmuls (e, full size: replicated under TP, all-gathered
      under SP). q and k are not saved by the rotary embedding (its products with the constant cos and
      sin tables save only the tables, cast to e: s x hd/2 each, cos and sin, for q and for k);
    * the unfused attention (torch's math kernel, the one used with dropout on CPU) in fp32: q and k
      scaled by 1/sqrt(sqrt(hd)) and v (4 bytes each; a cast copy of v in 16 bit), the softmax output,
      the dropout mask and the dropout output (4 + 4 + 4 bytes per score on CPU, fp32 noise; 4 + 1 + 4
      with a bool mask), a*s*s*b/t scores;
    * the attention output as reshaped for o_proj (e), and the MLP's gate output (saved by silu),
      silu's output and the up output (saved by their product), the product (saved by down_proj):
      4 tensors of f hidden units (e), sharded by t;
    * the dropout masks after o_proj and down_proj (m bytes per element, sharded by n).

    ``"full"``: the block's input (sharded under SP) and the RNG states it replays (the CPU
    generator's, and under TP the per-rank stream's). ``"selective"`` (the outputs of every ``mm``):
    the input, q/k/v and the gate and up outputs (sharded), o_proj's and down_proj's outputs (full
    size: with t > 1 they are the partial sums before the reduction), and the RNG states.
    """
    s, b, h, e, t = x.s, x.b, x.h, x.e, x.t
    sbh, n = s * b * h, t if x.sp else 1  # n: what divides the terms outside the regions
    kvh = h * x.kv // x.a
    rng = ("RNG states", x.rng * (2 if t > 1 else 1))
    if policy == "full":
        return [("block input", e * sbh / n), rng]
    if policy == "selective":
        return [("block input", e * sbh / n), ("q, k, v projections", e * s * b * (h + 2 * kvh) / t),
                ("o_proj output (before the reduction)", e * sbh),
                ("gate and up outputs", 2 * e * s * b * x.f / t),
                ("down_proj output (before the reduction)", e * sbh), rng]
    scores, m = x.a * s * s * b / t, 1 if x.native_dropout else e
    return [("RMSNorm inputs in fp32 (2)", 2 * 4 * sbh / n),
            ("RMSNorm normalised values (2)", 2 * e * sbh / n),
            ("RMSNorm reciprocal RMS (2)", 2 * 4 * s * b / n),
            ("RMSNorm outputs = region inputs (2)" + (", all-gathered" if x.sp else ""), 2 * e * sbh),
            ("rotary tables", 0 if e == 4 else 2 * 2 * s * (x.hd // 2) * e),
            ("attention q, k, v in fp32", 4 * s * b * (h + 2 * kvh) / t),
            ("attention softmax and dropout outputs (fp32)", 2 * 4 * scores),
            ("attention dropout mask", (1 if x.native_dropout else 4) * scores),
            ("o_proj input", e * sbh / t), ("MLP: gate, silu, up, product", 4 * e * s * b * x.f / t),
            ("dropout masks after o_proj, down_proj", 2 * m * sbh / n)]


def zero_states(psi: int, n: int, mixed: bool) -> dict[str, float]:
    """Model-state bytes per rank (ZeRO paper, section 3; DESIGN.md): fp32 Adam or mixed-precision Adam
    (16-bit parameters and gradients, fp32 master weights and moments)."""
    if mixed:
        return {"ddp": 16 * psi, "zero1": 4 * psi + 12 * psi / n, "zero2": 2 * psi + 14 * psi / n,
                "zero3": 16 * psi / n}
    return {"ddp": 16 * psi, "zero1": 8 * psi + 8 * psi / n, "zero2": 4 * psi + 12 * psi / n,
            "zero3": 16 * psi / n}
