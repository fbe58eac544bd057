"""A minGPT transformer block (KernelBench level 3 "MiniGPTBlock"), end to end.

``x -> x + attn(ln_1(x)); x -> x + mlp(ln_2(x))`` with causal self-attention written out
(``q, k, v = c_attn(x).split``; ``softmax(masked_fill(q k^T / sqrt(hd), future, -inf)) v``;
``c_proj``), the NewGELU MLP ``C -> 4C -> C`` and dropout 0. The block's I/O is fp32 and
its weights are fp32 master weights drawn from the seed like ``nn.Linear``'s init (the
inputs also carry fp16 copies, made once, as a deployment keeps them).

The launcher is a pipeline of cuBLAS GEMMs (``torch.mm``/``addmm``) and Triton kernels
for everything around them. Its tunables (``MiniGPTBlock.tunables``) are all real choices
with their own accuracy. ``PRECISION=fp16``: fp16 GEMM operands with fp32 accumulation
(cuBLAS's reduced-precision reductions off), fp16 attention operands and activations;
layer norm statistics, softmax statistics and both residual streams stay fp32 either
way. ``ATTN=flash`` never writes the T x T matrix; a head dim of 96 is padded to 128 with
masked loads or split (``FLASH_SPLIT_D``). ``ATTN=sdpa`` runs
``F.scaled_dot_product_attention(is_causal=True)`` on the c_attn output in place (cuDNN /
FlashAttention on NVIDIA; the search picks whichever is faster on the GPU at hand).
``FUSE_GELU=2`` is ``torch._addmm_activation(use_gelu=True)``, the tanh GELU on CUDA --
NewGELU exactly. ``FUSE_RESIDUAL=2`` passes the residual plus the MLP's c_proj bias as
that GEMM's C operand with an fp32 result (``addmm(..., out_dtype=float32)`` on CUDA: no
extra pass, and the MLP branch is never rounded to fp16).

The reference is the same math in fp64. Tolerance: ``PRECISION=fp32`` configs must meet
atol 1e-3 (the public write-up's bound); ``fp16`` configs get atol 1e-2 (see
``tolerance``); the harness records every trial's max abs error, so a report can say
which configs meet 1e-3.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
import triton

from harness.kernel.api import (
    BenchCase,
    Config,
    DeviceSpec,
    Inputs,
    Kernel,
    Launch,
    Planned,
    Shape,
    Tolerance,
    Tunable,
    register,
)
from kernels.minigpt_block.triton_kernels import (
    _bias_gelu_kernel,
    _bias_residual_kernel,
    _causal_softmax_kernel,
    _flash_attn_kernel,
    _flash_attn_split_kernel,
    _layernorm_kernel,
    _qkv_split_kernel,
)

_LN_EPS = 1e-5  # nn.LayerNorm's default
_LOG2E = 1.4426950408889634
# Linear layers: (name, out features / C, in features / C).
_LINEARS = (("c_attn", 3, 1), ("attn_proj", 1, 1), ("c_fc", 4, 1), ("mlp_proj", 1, 4))
_CHOICES = {
    "QKV_SPLIT": ("torch", "fused", "none"),
    "ATTN": ("fused_softmax", "flash", "sdpa"),
    "PRECISION": ("fp32", "fp16"),
    "FUSE_GELU": (0, 1, 2),
    "FUSE_RESIDUAL": (0, 1, 2),
    "FLASH_SPLIT_D": (0, 1),
}


def _pow2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


def _head_split(hd: int) -> int | None:
    """The first part D_A of a head dim that is the sum of two powers of two, both >= 16
    (96 = 64 + 32), for the flash kernel without padding; None for any other head dim
    (a power of two needs no split)."""
    d_a = _pow2(hd) // 2
    d_b = hd - d_a
    if hd & (hd - 1) == 0 or d_b < 16 or d_b & (d_b - 1):
        return None
    return d_a


def _head_block(hd: int) -> int:
    """The padded head dim of the flash kernel: a power of two, >= 16 for tl.dot."""
    return max(16, _pow2(hd))


def new_gelu(x: torch.Tensor) -> torch.Tensor:
    """minGPT's NewGELU, as written there."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi)
                                       * (x + 0.044715 * torch.pow(x, 3.0))))


def _block_math(x: torch.Tensor, p: Inputs, n_head: int, mask: torch.Tensor) -> torch.Tensor:
    """The KernelBench module's forward, in the dtype of ``x`` and ``p``."""
    B, T, C = x.shape
    hd = C // n_head
    h = F.layer_norm(x, (C,), p["ln_1_w"], p["ln_1_b"], _LN_EPS)
    q, k, v = F.linear(h, p["c_attn_w"], p["c_attn_b"]).split(C, dim=2)
    k = k.view(B, T, n_head, hd).transpose(1, 2)
    q = q.view(B, T, n_head, hd).transpose(1, 2)
    v = v.view(B, T, n_head, hd).transpose(1, 2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    att = att.masked_fill(mask[:, :, :T, :T] == 0, float("-inf"))
    att = F.softmax(att, dim=-1)
    y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
    x = x + F.linear(y, p["attn_proj_w"], p["attn_proj_b"])
    h = F.layer_norm(x, (C,), p["ln_2_w"], p["ln_2_b"], _LN_EPS)
    m = F.linear(new_gelu(F.linear(h, p["c_fc_w"], p["c_fc_b"])), p["mlp_proj_w"],
                 p["mlp_proj_b"])
    return x + m


def sdpa_fp16_block(inputs: Inputs, shape: Shape) -> torch.Tensor:
    """The second baseline: fp16 weights and activations around
    ``F.scaled_dot_product_attention(is_causal=True)``, layer norms and residuals fp32.
    Time it eager and under ``torch.compile``; it reads the fp16 weight copies that
    ``make_inputs`` provides, so no cast is timed."""
    x = inputs["x"]
    B, T, C = x.shape
    H = int(shape["H"])
    hd = C // H
    p = inputs
    h = F.layer_norm(x, (C,), p["ln_1_w"], p["ln_1_b"], _LN_EPS).half()
    q, k, v = F.linear(h, p["c_attn_w16"], p["c_attn_b16"]).split(C, dim=2)
    q = q.view(B, T, H, hd).transpose(1, 2)
    k = k.view(B, T, H, hd).transpose(1, 2)
    v = v.view(B, T, H, hd).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = y.transpose(1, 2).reshape(B, T, C)
    x = x + F.linear(y, p["attn_proj_w16"], p["attn_proj_b16"]).float()
    h = F.layer_norm(x, (C,), p["ln_2_w"], p["ln_2_b"], _LN_EPS).half()
    m = F.linear(new_gelu(F.linear(h, p["c_fc_w16"], p["c_fc_b16"])), p["mlp_proj_w16"],
                 p["mlp_proj_b16"])
    return x + m.float()


class _ExactAccumulation:
    """cuBLAS flags for the call, the caller's settings restored after: fp32 GEMMs must
    be fp32 (TF32 off), and fp16 GEMMs accumulate in fp32 (no reduced-precision split-K
    reductions)."""

    _FLAGS = ("allow_tf32", "allow_fp16_reduced_precision_reduction")

    def __enter__(self) -> None:
        m = torch.backends.cuda.matmul
        self.prev = [getattr(m, f) for f in self._FLAGS]
        for f in self._FLAGS:
            setattr(m, f, False)

    def __exit__(self, *exc: object) -> None:
        for f, v in zip(self._FLAGS, self.prev, strict=True):
            setattr(torch.backends.cuda.matmul, f, v)


@register("minigpt_block")
class MiniGPTBlock(Planned, Kernel):
    """minGPT block: causal self-attention + NewGELU MLP, pre-LN, fp32 I/O."""

    dims: ClassVar[tuple[str, ...]] = ("B", "T", "C", "H")
    # The model fixes T, C and H; only the batch is matched by nearest.
    exact_dims: ClassVar[tuple[str, ...]] = ("T", "C", "H")
    dtypes: ClassVar[tuple[str, ...]] = ("fp32",)
    # The first five are structural (and trade accuracy: PRECISION=fp16 is judged against
    # a looser bound, see tolerance); the rest are block sizes and warps of the Triton
    # kernel that each path uses (the others' values are ignored by that path). fp32
    # throughout by default: a user of an fp32 block gets fp32 accuracy unless a pack
    # says otherwise. AMD: 1-2 stages (its stream pipeliner; LDS is smaller than on
    # Hopper). The interpreter (cpu): warps and stages mean nothing there; tiles that run
    # fast.
    tunables: ClassVar[dict[str, Tunable]] = {
        "PRECISION": Tunable(_CHOICES["PRECISION"], default="fp32",
                             doc="GEMM, attention and activation dtype (fp16: fp32 "
                                 "accumulation); layer norms and residuals stay fp32"),
        "QKV_SPLIT": Tunable(_CHOICES["QKV_SPLIT"], default="fused",
                             doc="c_attn's output to head-major q / k^T / v by torch ops, "
                                 "one Triton pass, or not at all (none: read in place by "
                                 "ATTN=flash or sdpa)"),
        "ATTN": Tunable(_CHOICES["ATTN"], default="flash",
                        doc="fused_softmax: cuBLAS q k^T, one Triton pass for scale, mask "
                            "and softmax, cuBLAS P v; flash: one Triton kernel, online "
                            "softmax; sdpa: F.scaled_dot_product_attention in place"),
        "FUSE_GELU": Tunable(_CHOICES["FUSE_GELU"], default=1,
                             doc="0: torch ops; 1: Triton bias + GELU after mm; 2: cuBLASLt's "
                                 "bias + GELU epilogue"),
        "FUSE_RESIDUAL": Tunable(_CHOICES["FUSE_RESIDUAL"], default=1,
                                 doc="1: bias + residual (+ ln_2) in Triton row kernels; 2: "
                                     "also the MLP residual as the last GEMM's C; 0: torch"),
        "SPLIT_BLOCK_T": Tunable((32, 64, 128), default=64, hardware={"cpu": (64,)},
                                 doc="tokens per program of the fused q/k^T/v split"),
        "SPLIT_WARPS": Tunable((2, 4, 8), default=4, hardware={"cpu": (4,)}),
        "SOFTMAX_ROWS": Tunable((1, 2, 4), default=1, hardware={"cpu": (1, 4)},
                                doc="score rows per program of the causal softmax"),
        "SOFTMAX_WARPS": Tunable((1, 2, 4, 8), default=4, hardware={"cpu": (4,)}),
        "FLASH_BLOCK_M": Tunable((64, 128), default=64, hardware={"cpu": (64,)}),
        "FLASH_BLOCK_N": Tunable((32, 64, 128), default=32, hardware={"cpu": (64,)}),
        "FLASH_WARPS": Tunable((4, 8), default=4, hardware={"cpu": (4,)}),
        "FLASH_STAGES": Tunable((1, 2, 3), default=2, vendors={"amd": (1, 2)},
                                hardware={"cpu": (2,)}),
        "FLASH_SPLIT_D": Tunable(_CHOICES["FLASH_SPLIT_D"], default=0,
                                 doc="1: a head dim that is the sum of two powers of two "
                                     "(96 = 64 + 32) in two column parts, no padding"),
        "LN_ROWS": Tunable((1, 2, 4), default=1, hardware={"cpu": (4,)},
                           doc="C-wide rows per program of the layer norms"),
        "LN_WARPS": Tunable((2, 4, 8), default=4, hardware={"cpu": (4,)}),
        "EW_BLOCK": Tunable((512, 1024, 2048), default=1024, hardware={"cpu": (1024,)},
                            doc="bias + GELU and bias + residual element-wise kernels"),
        "EW_WARPS": Tunable((4, 8), default=4, hardware={"cpu": (4,)}),
    }
    bench: ClassVar[tuple[BenchCase, ...]] = (
        BenchCase("kernelbench-b32", "fp32", max_autotune=True),
        BenchCase("kernelbench-b128", "fp32"),
    )
    shapes: ClassVar[dict[str, dict[str, int]]] = {
        "kernelbench-b32": {"B": 32, "T": 512, "C": 768, "H": 8},
        "kernelbench-b128": {"B": 128, "T": 512, "C": 768, "H": 8},
        # Head dim 24 is padded to 32 in the flash kernel, as 96 is to 128.
        "test": {"B": 1, "T": 128, "C": 48, "H": 2},
    }

    # -- inputs and semantics ---------------------------------------------------------
    def make_inputs(self, shape: Shape, dtype: str, seed: int, device: str) -> Inputs:
        """x ~ N(0, 1); Linear weights and biases ~ U(-1/sqrt(in), 1/sqrt(in)) as
        nn.Linear initialises them; LayerNorm affine 1 + N(0, 0.1^2) and N(0, 0.1^2)
        (not the 1 / 0 init, so the affine parameters are exercised)."""
        s = self.validate_shape(shape)
        if dtype != "fp32":
            raise ValueError(f"{self.name}: the block's I/O is fp32, not {dtype}")
        B, T, C = s["B"], s["T"], s["C"]
        if C % s["H"]:
            raise ValueError(f"{self.name}: C={C} is not a multiple of H={s['H']}")
        g = torch.Generator(device="cpu").manual_seed(seed)
        out: Inputs = {"x": torch.randn(B, T, C, generator=g)}
        for ln in ("ln_1", "ln_2"):
            out[f"{ln}_w"] = 1.0 + 0.1 * torch.randn(C, generator=g)
            out[f"{ln}_b"] = 0.1 * torch.randn(C, generator=g)
        for name, n_out, n_in in _LINEARS:
            bound = 1.0 / math.sqrt(n_in * C)
            out[f"{name}_w"] = (2 * torch.rand(n_out * C, n_in * C, generator=g) - 1) * bound
            out[f"{name}_b"] = (2 * torch.rand(n_out * C, generator=g) - 1) * bound
        # The causal mask buffer of the module (its max_seqlen is T here).
        out["mask"] = torch.tril(torch.ones(T, T)).view(1, 1, T, T)
        out = {k: v.to(device) for k, v in out.items()}
        for name, _, _ in _LINEARS:
            out[f"{name}_w16"] = out[f"{name}_w"].half()
            out[f"{name}_b16"] = out[f"{name}_b"].half()
        return out

    def reference(self, inputs: Inputs, shape: Shape) -> torch.Tensor:
        p = {k: v.double() for k, v in inputs.items()
             if isinstance(v, torch.Tensor) and not k.endswith("16")}
        return _block_math(p["x"], p, int(shape["H"]), p["mask"])

    def eager(self, inputs: Inputs, shape: Shape) -> torch.Tensor:
        """The module as written, in fp32 (TF32 is whatever the process has set; torch
        leaves it off for matmuls by default)."""
        return _block_math(inputs["x"], inputs, int(shape["H"]), inputs["mask"])

    def baselines(self) -> dict[str, Callable[[Inputs, Shape], Callable[[], Any]]]:
        """What a user would pick instead: the block in fp16 with SDPA, eager and compiled."""
        compiled = torch.compile(sdpa_fp16_block)
        return {
            "sdpa fp16 eager": lambda i, s: lambda: sdpa_fp16_block(i, s),
            "torch.compile sdpa fp16": lambda i, s: lambda: compiled(i, s),
        }

    def _plan(self, inputs: Inputs, shape: Shape,
              config: Config) -> tuple[Callable[[], Any], list[Launch]]:
        """The block's forward for ``config`` (buffers allocated once) and the Triton
        launches it makes, so that what is compiled ahead is exactly what runs."""
        cfg = {**self.default_config, **config}
        s = self.validate_shape(shape)
        B, T, C, H = s["B"], s["T"], s["C"], s["H"]
        hd, BT = C // H, B * T
        x = inputs["x"].contiguous()
        dev = x.device
        fp16 = cfg["PRECISION"] == "fp16"
        pd = torch.float16 if fp16 else torch.float32
        sfx = "16" if fp16 else ""
        w = {n: inputs[f"{n}_w{sfx}"] for n, _, _ in _LINEARS}
        wt = {n: t.t() for n, t in w.items()}  # cuBLAS takes the transpose for free
        bias = {n: inputs[f"{n}_b{sfx}"] for n, _, _ in _LINEARS}
        ln1w, ln1b, ln2w, ln2b = (inputs[k] for k in ("ln_1_w", "ln_1_b", "ln_2_w", "ln_2_b"))
        mlp_b32 = inputs["mlp_proj_b"]  # fp32: FUSE_RESIDUAL=2 folds it into the residual
        split, attn = str(cfg["QKV_SPLIT"]), str(cfg["ATTN"])
        fuse_gelu, fuse_res = int(cfg["FUSE_GELU"]), int(cfg["FUSE_RESIDUAL"])
        if (split == "none" and attn == "fused_softmax") or (attn == "sdpa" and split != "none"):
            raise ValueError("QKV_SPLIT=none goes with ATTN=flash or sdpa, sdpa with none")
        qk_scale = _LOG2E / math.sqrt(hd)

        # Work buffers, allocated once.
        x2d = x.view(BT, C)
        out = torch.empty_like(x)
        out2d = out.view(BT, C)
        h1 = torch.empty(BT, C, device=dev, dtype=pd)
        qkv = torch.empty(BT, 3 * C, device=dev, dtype=pd)
        y2d = torch.empty(BT, C, device=dev, dtype=pd)
        a = torch.empty(BT, C, device=dev, dtype=pd)
        x1 = torch.empty(BT, C, device=dev, dtype=torch.float32)
        h2 = torch.empty(BT, C, device=dev, dtype=pd)
        f = torch.empty(BT, 4 * C, device=dev, dtype=pd)
        m = torch.empty(BT, C, device=dev, dtype=pd)

        # q, k, v as (tensor, strides (b, h, t, d)); the d stride of q and v is 1.
        if split == "none":
            q = qkv[:, :C]
            k = qkv[:, C:2 * C]
            v = qkv[:, 2 * C:]
            rs = 3 * C
            q_st, k_st, v_st = (T * rs, hd, rs, 1), (T * rs, hd, rs, 1), (T * rs, hd, rs, 1)
        else:
            q = torch.empty(B, H, T, hd, device=dev, dtype=pd)
            k = torch.empty(B, H, hd, T, device=dev, dtype=pd)  # k^T
            v = torch.empty(B, H, T, hd, device=dev, dtype=pd)
            q_st = v_st = (H * T * hd, T * hd, hd, 1)
            k_st = (H * hd * T, hd * T, 1, T)
        qkv5 = qkv.view(B, T, 3, H, hd)

        ln_rows = int(cfg["LN_ROWS"])
        ln_grid = (triton.cdiv(BT, ln_rows),)
        ln_kw = {"ROWS": ln_rows, "BLOCK_C": _pow2(C), "num_warps": int(cfg["LN_WARPS"])}
        ew_block, ew_warps = int(cfg["EW_BLOCK"]), int(cfg["EW_WARPS"])
        ln1 = Launch(_layernorm_kernel, ln_grid,
                      (x2d, x2d, ln1b, x2d, ln1b, ln1w, ln1b, h1, BT, C, _LN_EPS),
                      {"FUSED_RES": False, "XO_BIAS": False, **ln_kw})
        if fuse_res:
            ln2 = Launch(_layernorm_kernel, ln_grid,
                          (x2d, a, bias["attn_proj"], x1, mlp_b32, ln2w, ln2b, h2, BT, C,
                           _LN_EPS), {"FUSED_RES": True, "XO_BIAS": fuse_res == 2, **ln_kw})
        else:
            ln2 = Launch(_layernorm_kernel, ln_grid,
                          (x1, x1, ln2b, x1, ln2b, ln2w, ln2b, h2, BT, C, _LN_EPS),
                          {"FUSED_RES": False, "XO_BIAS": False, **ln_kw})
        launches = [ln1, ln2]
        if fuse_gelu == 1:
            gelu = Launch(_bias_gelu_kernel, (triton.cdiv(f.numel(), ew_block),),
                           (f, bias["c_fc"], f, f.numel(), 4 * C),
                           {"BLOCK": ew_block, "num_warps": ew_warps})
            launches.append(gelu)
        if fuse_res == 1:
            resid = Launch(_bias_residual_kernel, (triton.cdiv(m.numel(), ew_block),),
                            (m, bias["mlp_proj"], x1, out2d, m.numel(), C),
                            {"BLOCK": ew_block, "num_warps": ew_warps})
            launches.append(resid)
        if split == "fused":
            bt = int(cfg["SPLIT_BLOCK_T"])
            qkv_split = Launch(_qkv_split_kernel, (triton.cdiv(T, bt), B * H),
                                (qkv, q, k, v, T, H, C),
                                {"HD": hd, "BLOCK_T": bt, "BLOCK_D": _pow2(hd),
                                 "num_warps": int(cfg["SPLIT_WARPS"])})
            launches.append(qkv_split)

        def gelu_epilogue(h: torch.Tensor, out_: torch.Tensor) -> None:
            if dev.type == "cuda":
                # cuBLASLt's GELU_BIAS epilogue; its GELU is the tanh form on CUDA.
                torch._addmm_activation(bias["c_fc"], h, wt["c_fc"], use_gelu=True, out=out_)
            else:
                # Off CUDA the op means the erf GELU, so the same math in two steps.
                torch.addmm(bias["c_fc"], h, wt["c_fc"], out=out_)
                out_.copy_(F.gelu(out_, approximate="tanh"))

        def split_qkv() -> None:
            if split == "torch":
                q.copy_(qkv5[:, :, 0].transpose(1, 2))
                k.copy_(qkv5[:, :, 1].permute(0, 2, 3, 1))
                v.copy_(qkv5[:, :, 2].transpose(1, 2))
            elif split == "fused":
                qkv_split()

        if attn == "flash":
            bm, bn = int(cfg["FLASH_BLOCK_M"]), int(cfg["FLASH_BLOCK_N"])
            flash_grid = (triton.cdiv(T, bm), B * H)
            flash_args = (q, k, v, y2d, q_st[0], q_st[1], q_st[2], k_st[0], k_st[1], k_st[2],
                          k_st[3], v_st[0], v_st[1], v_st[2], T, H, C, qk_scale)
            flash_kw = {"HD": hd, "BLOCK_M": bm, "BLOCK_N": bn, "IEEE": not fp16,
                        "num_warps": int(cfg["FLASH_WARPS"]),
                        "num_stages": int(cfg["FLASH_STAGES"])}
            if int(cfg["FLASH_SPLIT_D"]):
                d_a = _head_split(hd)
                if d_a is None:
                    raise ValueError(f"FLASH_SPLIT_D=1: head dim {hd} has no split")
                flash_kernel, flash_kw["D_A"] = _flash_attn_split_kernel, d_a
            else:
                flash_kernel, flash_kw["BLOCK_D"] = _flash_attn_kernel, _head_block(hd)
            flash = Launch(flash_kernel, flash_grid, flash_args, flash_kw)
            launches.append(flash)
        elif attn == "sdpa":
            # [B, H, T, hd] views of the c_attn output: no copy on the way in.
            q4, k4, v4 = (qkv5[:, :, i].transpose(1, 2) for i in range(3))
        else:
            scores = torch.empty(B * H, T, T, device=dev, dtype=pd)
            yh = torch.empty(B * H, T, hd, device=dev, dtype=pd)
            rows = int(cfg["SOFTMAX_ROWS"])
            sm_grid = (triton.cdiv(B * H * T, rows),)
            sm_kw = {"ROWS": rows, "BLOCK_T": _pow2(T), "num_warps": int(cfg["SOFTMAX_WARPS"])}
            q3, k3, v3 = q.view(B * H, T, hd), k.view(B * H, hd, T), v.view(B * H, T, hd)
            softmax = Launch(_causal_softmax_kernel, sm_grid,
                              (scores, B * H * T, T, qk_scale), sm_kw)
            launches.append(softmax)

        def attention() -> torch.Tensor:
            """Attention's output as [B*T, C], head h at columns h*hd (c_proj's input)."""
            if attn == "flash":
                flash()
                return y2d
            if attn == "sdpa":
                y = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True)
                # The fused backends write [B, T, H, hd] and return its [B, H, T, hd] view,
                # so this reshape is free; otherwise it copies.
                return y.transpose(1, 2).reshape(BT, C)
            torch.bmm(q3, k3, out=scores)
            softmax()
            torch.bmm(scores, v3, out=yh)
            y2d.view(B, T, H, hd).copy_(yh.view(B, H, T, hd).transpose(1, 2))
            return y2d

        def forward() -> torch.Tensor:
            ln1()
            torch.addmm(bias["c_attn"], h1, wt["c_attn"], out=qkv)
            split_qkv()
            y = attention()
            if fuse_res:
                torch.mm(y, wt["attn_proj"], out=a)
            else:
                torch.addmm(bias["attn_proj"], y, wt["attn_proj"], out=a)
                torch.add(x2d, a, out=x1)
            ln2()
            if fuse_gelu == 2:
                gelu_epilogue(h2, f)
                g = f
            elif fuse_gelu:
                torch.mm(h2, wt["c_fc"], out=f)
                gelu()
                g = f
            else:
                torch.addmm(bias["c_fc"], h2, wt["c_fc"], out=f)
                g = new_gelu(f)
            if fuse_res == 2:
                # x1 already holds the residual plus the c_proj bias: out = x1 + g @ W^T.
                if not fp16:
                    torch.addmm(x1, g, wt["mlp_proj"], out=out2d)
                elif dev.type == "cuda":
                    return torch.addmm(x1, g, wt["mlp_proj"], out_dtype=torch.float32).view(
                        B, T, C)
                else:
                    # No fp16 -> fp32 GEMM off CUDA: the same products and fp32 sums.
                    torch.addmm(x1, g.float(), wt["mlp_proj"].float(), out=out2d)
            elif fuse_res:
                torch.mm(g, wt["mlp_proj"], out=m)
                resid()
            else:
                torch.addmm(bias["mlp_proj"], g, wt["mlp_proj"], out=m)
                torch.add(x1, m, out=out2d)
            return out

        def run() -> torch.Tensor:
            with _ExactAccumulation():
                return forward()

        return run, launches

    # -- cost model -------------------------------------------------------------------
    def flops(self, shape: Shape) -> float:
        """The four GEMMs (2 * B*T * 12 C^2) plus attention's two batched GEMMs counted
        over the full T x T (4 * B * T^2 * C), as the eager module computes them; the
        causal kernels do about half of the latter. Element-wise work is not counted."""
        s = self.validate_shape(shape)
        B, T, C = s["B"], s["T"], s["C"]
        return float(24 * B * T * C * C + 4 * B * T * T * C)

    def bytes_moved(self, shape: Shape, dtype: str) -> float:
        """x in and out (fp32) and the weights once, at 2 bytes (the fp16 configs' copies;
        the fewest any config reads); LN parameters fp32."""
        s = self.validate_shape(shape)
        B, T, C = s["B"], s["T"], s["C"]
        linear_params = 12 * C * C + 9 * C
        return float(4 * 2 * B * T * C + 2 * linear_params + 4 * 4 * C)

    def compute_dtype(self, dtype: str) -> str | None:
        # The roofline is the bound of the fastest legal config: fp16 tensor-core GEMMs.
        return "fp16"

    # -- accuracy and validity --------------------------------------------------------
    def precision(self, config: Config, dtype: str) -> str:
        """PRECISION=fp32: ieee fp32 GEMMs and attention (TF32 off); fp16: fp16 operands with
        fp32 accumulation."""
        return "fp16" if str({**self.default_config, **config}["PRECISION"]) == "fp16" \
            else "ieee fp32"

    def tolerance(self, dtype: str, config: Config) -> Tolerance:
        """fp32 configs: atol 1e-3 (the public write-up's bound), with little relative
        slack (outputs are O(1), up to ~6). fp16 configs: atol 1e-2 -- the branch outputs
        pass through fp16 operands (2^-11 relative rounding) before the fp32 residual;
        their max errors are recorded per trial, so whether one meets 1e-3 is reported,
        not assumed."""
        if str({**self.default_config, **config}["PRECISION"]) == "fp16":
            return Tolerance(1e-2, 1e-3)
        return Tolerance(1e-3, 1e-5)

    def check_config(self, config: Config, shape: Shape, device: DeviceSpec) -> str | None:
        cfg = {**self.default_config, **config}
        s = self.validate_shape(shape)
        T, C, H = s["T"], s["C"], s["H"]
        if C % H:
            return f"C={C} is not a multiple of H={H}"
        for name, allowed in _CHOICES.items():
            if cfg[name] not in allowed:
                return f"{name}={cfg[name]!r}: one of {list(allowed)}"
        if cfg["QKV_SPLIT"] == "none" and cfg["ATTN"] == "fused_softmax":
            return "QKV_SPLIT=none (q, k, v read in place) needs ATTN=flash or sdpa"
        if cfg["ATTN"] == "sdpa" and cfg["QKV_SPLIT"] != "none":
            return "ATTN=sdpa reads q, k, v in place: it needs QKV_SPLIT=none"
        if (int(cfg["FUSE_RESIDUAL"]) == 2 and cfg["PRECISION"] == "fp16"
                and not hasattr(torch.ops.aten.addmm, "dtype")):
            return f"FUSE_RESIDUAL=2: torch {torch.__version__} has no addmm(out_dtype=)"
        pow2 = ("SPLIT_BLOCK_T", "SPLIT_WARPS", "SOFTMAX_ROWS", "SOFTMAX_WARPS",
                "FLASH_BLOCK_M", "FLASH_BLOCK_N", "FLASH_WARPS", "LN_ROWS", "LN_WARPS", "EW_BLOCK",
                "EW_WARPS")
        for name in pow2:
            v = int(cfg[name])
            if v < 1 or v & (v - 1):
                return f"{name}={v} is not a power of two"
        bm, bn = int(cfg["FLASH_BLOCK_M"]), int(cfg["FLASH_BLOCK_N"])
        if min(bm, bn) < 16:
            return "FLASH_BLOCK_M and FLASH_BLOCK_N must be >= 16 (tl.dot)"
        if int(cfg["FLASH_STAGES"]) < 1:
            return f"FLASH_STAGES={cfg['FLASH_STAGES']} must be >= 1"
        # Like every FLASH_* value, FLASH_SPLIT_D is ignored by the other attentions.
        if cfg["ATTN"] == "flash" and int(cfg["FLASH_SPLIT_D"]) and _head_split(C // H) is None:
            return (f"FLASH_SPLIT_D=1: head dim {C // H} is not the sum of two powers of "
                    "two >= 16")
        if device.interpreted:
            return None  # no registers or shared memory to run out of
        lanes = 64 if device.vendor == "amd" else 32
        hd = C // H
        if cfg["ATTN"] == "flash":
            # The split kernel holds exactly hd columns; the other pads them to a power of 2.
            bd = hd if int(cfg["FLASH_SPLIT_D"]) else _head_block(hd)
            stages = int(cfg["FLASH_STAGES"])
            if device.vendor == "amd":
                # q resident; the stream pipeliner keeps one stage in registers.
                item = 2 if cfg["PRECISION"] == "fp16" else 4
                smem = (bm * bd + max(1, stages - 1) * 2 * bn * bd) * item
            elif cfg["PRECISION"] == "fp16":
                # q resident plus a k and a v tile per stage: Triton 3.9's sm_90
                # allocation exactly.
                smem = (bm * bd + stages * 2 * bn * bd) * 2
            else:
                # fp32 (FMA) dots: pipelined v gets one buffer fewer than k; an upper
                # fit of Triton 3.9's sm_90 allocations (exact for one stage).
                smem = (bm * bd + max(2 * stages - 1, 2) * bn * bd) * 4
            if smem > device.smem_per_block:
                return f"flash: shared memory ~{smem} B > {device.smem_per_block} B per block"
            # The fp32 accumulator and score tile live in registers; fp32 (FMA) dots hold
            # the q tile there too. Past 256 per thread they spill: on an H100, 128 x 128
            # fp32 tiles on 4 warps compiled for over 90 s, 128 x 64 ones ran 9x slower.
            values = bm * bd + bm * bn + (0 if cfg["PRECISION"] == "fp16" else bm * bd)
            per_thread = values // (lanes * int(cfg["FLASH_WARPS"]))
            if per_thread > 256:
                return (f"flash: {per_thread} fp32 accumulator, score and q values per thread "
                        "> 256 (register spills)")
        elif cfg["ATTN"] == "fused_softmax":
            per_thread = int(cfg["SOFTMAX_ROWS"]) * _pow2(T) // (lanes * int(cfg["SOFTMAX_WARPS"]))
            if per_thread > 128:
                return f"softmax: {per_thread} values per thread > 128"
        if cfg["QKV_SPLIT"] == "fused":
            per_thread = int(cfg["SPLIT_BLOCK_T"]) * _pow2(hd) // (lanes * int(cfg["SPLIT_WARPS"]))
            if per_thread > 128:
                return f"qkv split: {per_thread} values per thread and tile > 128"
        ln_per_thread = int(cfg["LN_ROWS"]) * _pow2(C) // (lanes * int(cfg["LN_WARPS"]))
        if ln_per_thread > 64:
            return f"layer norm: {ln_per_thread} values per thread > 64"
        if int(cfg["FUSE_GELU"]) == 1 or int(cfg["FUSE_RESIDUAL"]) == 1:
            if int(cfg["EW_BLOCK"]) // (lanes * int(cfg["EW_WARPS"])) > 64:
                return f"EW_BLOCK={cfg['EW_BLOCK']} over {cfg['EW_WARPS']} warps: > 64 per thread"
        return None
