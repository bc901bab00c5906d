"""HF <-> megatron-core mapping: hpcrl's own (hpcrl/train/bridge.py + hf_config.py and the families' modules)
against mbridge (issue #35 point 8), side by side in one process, on the same tiny random HF models made with
the installed transformers.

For each family (Qwen3-MoE with and without ``norm_topk_prob``, GLM-4.5-style ``glm4_moe`` and a variant
without qkv bias and with two shared experts, DeepSeek-V3-style ``deepseek_v3`` with group-limited routing)
and each bridge, it builds the megatron-core GPTModel on this CPU (gloo), loads the HF safetensors, and
measures

- exactness: HF -> Megatron -> HF export bitwise (every HF tensor, same names, ``torch.equal``) and the
  logits' max ``|megatron - HF|`` in fp32 (random tokens [2, 12]); "mbridge + config_fixes" rows repeat
  mbridge with the ``TransformerConfig`` fields its per-family config leaves out (:func:`config_fixes`);
- the patches mbridge needs to run here, each applied by a function of this file (listed with its line count);
- lines of code (physical and code lines: no blanks, comments or docstrings) of each side's mapping;
- speed: seconds to load the HF folder into the model and to export every HF-named full tensor out of it, on a
  larger Qwen3-MoE, ``--repeats`` times, the two bridges alternating (the CPU is shared: the ratio is the
  figure to read).

mbridge is optional: install it outside the project's environment and put it on the path, e.g.

    python -m pip install --no-deps --target /work/mbridge-pkgs mbridge==0.15.1
    PYTHONPATH=$PWD:/work/mbridge-pkgs python benchmarks/bench_bridge_vs_mbridge.py [--repeats 5]
    PYTHONPATH=$PWD:/work/mbridge-pkgs torchrun --nproc_per_node 2 \\
        benchmarks/bench_bridge_vs_mbridge.py --tp 2      (or --ep 2: exactness only; rank 0 prints)

Without it the mbridge rows say so and the hpcrl rows are still measured. Under torchrun a bridge that fails
on some ranks only (mbridge reads the checkpoint on TP rank 0 and scatters) leaves the others in a collective:
leave such a family out with ``--families``. Results: docs/performance.md; the decision they support:
docs/architecture.md ("HF <-> Megatron mapping: own code or mbridge").
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import inspect
import io
import re
import statistics
import sys
import tempfile
import time
import types
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/machine.py, also under `python -m`
from machine import machine_header  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMMON = dict(vocab_size=37, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # name -> (HF model_type, config fields besides COMMON)
    "qwen3_moe": ("qwen3_moe", dict(num_key_value_heads=2, head_dim=24, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=48, norm_topk_prob=True)),
    "qwen3_moe norm_topk_prob=False": ("qwen3_moe", dict(num_key_value_heads=2, head_dim=24, num_experts=4,
                                                         num_experts_per_tok=2, moe_intermediate_size=48,
                                                         norm_topk_prob=False)),
    # GLM-4.5's shape: qkv bias, QK norm (GLM-4.5 has none, 4.6 some), partial RoPE, 1 shared expert,
    # first layer dense, sigmoid router with e_score_correction_bias, one group
    "glm4_moe": ("glm4_moe", dict(num_key_value_heads=2, head_dim=16, attention_bias=True, use_qk_norm=True,
                                  n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                  moe_intermediate_size=48, first_k_dense_replace=1, n_group=1, topk_group=1,
                                  routed_scaling_factor=2.5, norm_topk_prob=True,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                   "partial_rotary_factor": 0.5})),
    # the same without qkv bias and with 2 shared experts (fields GLM's config has; mbridge hard-codes both)
    "glm4_moe attention_bias=False n_shared_experts=2": ("glm4_moe", dict(
        num_key_value_heads=2, head_dim=16, attention_bias=False, use_qk_norm=True, n_routed_experts=4,
        n_shared_experts=2, num_experts_per_tok=2, moe_intermediate_size=48, first_k_dense_replace=1,
        n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})),
    # DeepSeek-V3's shape: MLA with q and kv LoRA, group-limited routing (8 experts in 2 groups, best group);
    # a vocab TP divides: mbridge's DeepSeek-V3 bridge does not pad it (the published 129280 divides)
    "deepseek_v3": ("deepseek_v3", dict(vocab_size=64, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                                        moe_intermediate_size=48, first_k_dense_replace=1, n_group=2,
                                        topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
}
SPEED_MODEL = ("qwen3_moe", dict(COMMON, vocab_size=4096, hidden_size=512, num_hidden_layers=4,
                                 num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=32,
                                 num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True))
"""The model timed: a Qwen3-MoE of ~55M parameters (4 layers, 32 experts of 512 x 256)."""


def make_hf(model_type: str, fields: dict[str, Any], path: Path, seed: int = 1) -> Path:
    """Save a random HF causal LM of ``model_type`` (norm weights in [0.5, 1.5] and expert score biases in
    [-0.1, 0.1], so that a mix-up shows) as safetensors in ``path``. Under torchrun rank 0 saves (transformers
    writes the config on the main process only) and every rank waits for it."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return save_random_hf(model_type, fields, path, seed)
    if dist.get_rank() == 0:
        save_random_hf(model_type, fields, path, seed)
    dist.barrier()
    return path


def save_random_hf(model_type: str, fields: dict[str, Any], path: Path, seed: int) -> Path:
    """:func:`make_hf` in this process."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**COMMON, **fields})
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for name, t in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith("norm.weight"):
                    t.uniform_(0.5, 1.5)
                elif name.endswith("e_score_correction_bias"):
                    t.uniform_(-0.1, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


# ---------------------------------------------------------------------------------------------------------
# hpcrl's bridge
# ---------------------------------------------------------------------------------------------------------

class HpcrlSide:
    """hpcrl.train.bridge: build, load, export."""

    name = "hpcrl"

    def build_and_load(self, path: Path):
        from transformers import AutoConfig

        from hpcrl.train import bridge

        model = bridge.build_gpt_model(AutoConfig.from_pretrained(str(path)))
        bridge.load_hf_weights(model, path)
        return model.eval()

    def load(self, model, path: Path) -> None:
        from hpcrl.train import bridge

        bridge.load_hf_weights(model, path)

    def export(self, model) -> dict[str, torch.Tensor]:
        from hpcrl.train import bridge

        return dict(bridge.export_hf_weights(model))


# ---------------------------------------------------------------------------------------------------------
# mbridge, and the patches it needs on this CPU (each one function, so that its size is measured)
# ---------------------------------------------------------------------------------------------------------

_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_LOCAL_NORMS = (  # local-spec norm -> the TransformerEngine-fused name mbridge's tables know
    (re.compile(r"\.input_layernorm\.weight$"), ".self_attention.linear_qkv.layer_norm_weight"),
    (re.compile(r"\.pre_mlp_layernorm\.weight$"), ".mlp.linear_fc1.layer_norm_weight"),
    (re.compile(r"\.self_attention\.q_layernorm\.weight$"),
     ".self_attention.linear_q_up_proj.layer_norm_weight"),
    (re.compile(r"\.self_attention\.kv_layernorm\.weight$"),
     ".self_attention.linear_kv_up_proj.layer_norm_weight"),
)


def patch_hf_config_fields(hf_config) -> None:
    """transformers 5 keeps ``rope_theta`` and ``partial_rotary_factor`` in ``rope_parameters``; mbridge
    0.15.1 reads them as attributes (AttributeError). Copy them up."""
    for key, value in (getattr(hf_config, "rope_parameters", None) or {}).items():
        if not hasattr(hf_config, key):
            setattr(hf_config, key, value)


def patch_local_layer_spec() -> None:
    """mbridge builds TransformerEngine layer specs (``use_transformer_engine=True``: NameError ``TENorm``
    without TE). Use megatron-core's local spec; also moves the ``torch.cuda`` calls of its model build and
    export onto hpcrl's CPU alias of torch (``hpcrl.train.cpu_compat``)."""
    import megatron.core.utils as mcore_utils
    from mbridge.core import bridge as mb_bridge, llm_bridge, util
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    def local_spec(self, vp_stage=None):
        return get_gpt_decoder_block_spec(self.config, use_transformer_engine=False, normalization="RMSNorm",
                                          vp_stage=vp_stage)

    llm_bridge.LLMBridge._get_transformer_layer_spec = local_spec
    util.torch = mb_bridge.torch = mcore_utils.torch  # the CPU alias cpu_compat.apply() installed


def patch_local_names(mb) -> None:
    """mbridge's name tables are written for TE modules: fused norms (``linear_qkv.layer_norm_weight``) and
    grouped experts (``experts.linear_fc1.weight{j}``). The local spec has separate norms and SequentialMLP
    experts (``experts.local_experts.{j}.linear_fc1.weight``): translate before its lookup."""
    lookup = mb._weight_name_mapping_mcore_to_hf

    def mapping(name: str) -> list[str]:
        name = _LOCAL_EXPERT.sub(r".mlp.experts.\2.weight\1", name)
        try:
            return lookup(name)
        except (NotImplementedError, KeyError):
            for pattern, fused in _LOCAL_NORMS:
                if pattern.search(name):
                    return lookup(pattern.sub(fused, name))
            raise

    mb._weight_name_mapping_mcore_to_hf = mapping


def patch_expert_parallel_names(mb) -> None:
    """mbridge finds routed experts for expert parallelism (global index on load, all-gather on export) by
    TE's grouped name ``.mlp.experts.linear_fc``; SequentialMLP's ``local_experts.{j}`` pass unseen, so at
    EP > 1 each rank loads experts 0.. and exports only its own. Rename them in its local -> global name
    map."""
    to_global = mb._weight_name_mapping_mcore_local_to_global

    def mapping(model, consider_ep: bool = True) -> dict[str, str]:
        offset = 0
        if consider_ep and mb.mpu.ep_size > 1:
            offset = mb.mpu.ep_rank * (mb.config.num_moe_experts // mb.mpu.ep_size)
        def grouped(m: re.Match) -> str:
            return f".mlp.experts.{m.group(2)}.weight{int(m.group(1)) + offset}"

        names = to_global(model, consider_ep=consider_ep)
        return {k: _LOCAL_EXPERT.sub(grouped, v) for k, v in names.items()}

    mb._weight_name_mapping_mcore_local_to_global = mapping


def patch_mla_config_name() -> None:
    """mbridge 0.15.1's DeepSeek-V3 config passes ``max_position_embeddings`` to ``MLATransformerConfig``,
    which megatron-core 0.16.1 names ``original_max_position_embeddings`` (TypeError)."""
    from mbridge.models import deepseek_v3
    from megatron.core.transformer import MLATransformerConfig

    def config(**kwargs):
        if "max_position_embeddings" in kwargs:
            kwargs["original_max_position_embeddings"] = kwargs.pop("max_position_embeddings")
        return MLATransformerConfig(**kwargs)

    deepseek_v3.DeepseekV3Bridge.TransformerConfigClass = staticmethod(config)


def patch_mla_fp32_reader(mb) -> None:
    """mbridge 0.15.1's DeepSeek-V3 reads checkpoints only through its FP8-dequantising reader and only for
    bf16 (``raise NotImplemented("only support bfloat16 for now")``, itself a TypeError). Use its plain
    reader."""
    from mbridge.core.safetensor_io import SafeTensorIO

    mb._get_safetensor_io = lambda path: SafeTensorIO(mb._get_actual_hf_path(path))


class MLACoreAttention(torch.nn.Module):
    """Causal softmax attention whose q/k head size differs from v's: query/key ``[s, b, h, dk]``, value
    ``[s, b, h, dv]`` -> ``[s, b, h * dv]``, scaled by megatron's ``softmax_scale``. megatron-core 0.16.1's
    local ``DotProductAttention`` takes one head size (TypeError ``k_channels``); hpcrl needs the same for
    MLA."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                               scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


def patch_mla_core_attention(mb) -> None:
    """MLA on the CPU (megatron-core, not mbridge): a core attention with separate q/k and v head sizes
    (:class:`MLACoreAttention`), and TransformerEngine marked absent in ``multi_latent_attention`` (its
    ``isinstance(..., TELinear)`` against a None stand-in is a TypeError)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False

    def spec(self, vp_stage=None):
        block = get_gpt_decoder_block_spec(self.config, use_transformer_engine=False, normalization="RMSNorm",
                                           vp_stage=vp_stage)
        for layer in block.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = MLACoreAttention
        return block

    mb._get_transformer_layer_spec = types.MethodType(spec, mb)


PATCHES: tuple[tuple[Callable, str, str], ...] = (
    (patch_hf_config_fields, "all", "transformers 5 config: copy rope_theta / partial_rotary_factor out of "
                                    "rope_parameters (AttributeError)"),
    (patch_local_layer_spec, "all", "local layer spec instead of TE's (NameError TENorm); torch.cuda "
                                    "calls of get_model / export on hpcrl's CPU alias"),
    (patch_local_names, "all", "local-spec names (separate norms, SequentialMLP experts) -> the TE names of "
                               "mbridge's tables"),
    (patch_expert_parallel_names, "MoE at EP > 1", "SequentialMLP experts in its EP name map (else wrong "
                                                   "experts loaded, own experts exported)"),
    (patch_mla_config_name, "deepseek_v3", "MLATransformerConfig kwarg renamed in megatron-core 0.16 "
                                           "(max_position_embeddings, TypeError)"),
    (patch_mla_fp32_reader, "deepseek_v3", "plain safetensors reader: mbridge's DeepSeek-V3 reads bf16 only"),
    (patch_mla_core_attention, "deepseek_v3", "megatron-core, not mbridge (hpcrl needs the same): core "
                                              "attention with q/k head size != v (MLACoreAttention), HAVE_TE "
                                              "off in MLA"),
)


def config_fixes(hf_config) -> dict[str, Any]:
    """The ``TransformerConfig`` fields mbridge 0.15.1 leaves out and HF's routing needs (its mappings ignore
    them): Qwen3-MoE's ``norm_topk_prob=False`` is softmax over all experts before the top-k
    (``moe_router_pre_softmax``; mbridge always sets False), and group-limited routing (``n_group``,
    ``topk_group``: ``moe_router_num_groups``, ``moe_router_group_topk``; mbridge sets neither); for GLM,
    ``attention_bias`` and ``n_shared_experts`` (mbridge: always qkv bias, one shared expert)."""
    fixes: dict[str, Any] = {}
    if hf_config.model_type == "glm4_moe" and not hf_config.attention_bias:
        fixes["add_qkv_bias"] = False
    if hf_config.model_type == "glm4_moe" and hf_config.n_shared_experts != 1:
        shared = hf_config.n_shared_experts * hf_config.moe_intermediate_size
        fixes["moe_shared_expert_intermediate_size"] = shared
    if hf_config.model_type == "qwen3_moe" and not getattr(hf_config, "norm_topk_prob", True):
        fixes["moe_router_pre_softmax"] = True
    if (getattr(hf_config, "n_group", None) or 1) > 1:
        fixes.update(moe_router_num_groups=hf_config.n_group, moe_router_group_topk=hf_config.topk_group)
    return fixes


def cpu_overrides(model_type: str) -> dict[str, Any]:
    """``TransformerConfig`` fields set through mbridge's public ``set_extra_args`` (configuration, not code):
    no grouped GEMM (needs TE or grouped_gemm), no fusions, CPU initialisation, and for DeepSeek-V3 megatron's
    default attention backend (mbridge asks for TE's fused one; ``auto``, as the other models in this process,
    whose ``NVTE_*`` variables megatron checks process-wide) and no MTP layers (transformers 5.24 neither
    builds nor saves them)."""
    kwargs: dict[str, Any] = dict(moe_grouped_gemm=False, use_cpu_initialization=True,
                                  persist_layer_norm=False, bias_activation_fusion=False,
                                  bias_dropout_fusion=False,
                                  masked_softmax_fusion=False, apply_rope_fusion=False,
                                  gradient_accumulation_fusion=False)
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        kwargs["sequence_parallel"] = False  # mbridge turns it on at TP > 1; torch's norms refuse it
    if model_type == "deepseek_v3":
        from megatron.core.transformer.enums import AttnBackend

        kwargs.update(attention_backend=AttnBackend.auto, mtp_num_layers=None)
    return kwargs


class MbridgeSide:
    """mbridge's ``AutoBridge``: build (``get_model``), ``load_weights``, ``export_weights``."""

    name = "mbridge"

    def __init__(self, fix_config: bool = False):
        import mbridge

        self.fix_config = fix_config
        if fix_config:
            self.name = "mbridge + config_fixes"

        self.version = mbridge.__version__
        patch_local_layer_spec()
        patch_mla_config_name()
        self.bridges: dict[int, Any] = {}

    def build_and_load(self, path: Path):
        from mbridge import AutoBridge
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(str(path))
        patch_hf_config_fields(hf_config)
        mla = hf_config.model_type == "deepseek_v3"
        # its DeepSeek-V3 provider leaves the vocab unpadded (and asserts on padding): pad only the others
        mb = AutoBridge.from_config(hf_config, dtype=torch.float32,
                                    make_vocab_size_divisible_by=None if mla else 128)
        patch_local_names(mb)
        patch_expert_parallel_names(mb)
        if mla:
            patch_mla_fp32_reader(mb)
            patch_mla_core_attention(mb)
        mb.set_extra_args(**cpu_overrides(hf_config.model_type),
                          **(config_fixes(hf_config) if self.fix_config else {}))
        with contextlib.redirect_stdout(io.StringIO()):  # its parameter-count line
            # use_torch_fsdp2 with use_cpu_initialization only skips get_model's model.cuda() (no DDP here)
            model = mb.get_model(bf16=False, use_cpu_initialization=True, wrap_with_ddp=False,
                                 use_torch_fsdp2=True)[0]
        mb.load_weights([model], str(path))
        self.bridges[id(model)] = mb
        return model.eval()

    def load(self, model, path: Path) -> None:
        self.bridges[id(model)].load_weights([model], str(path))

    def export(self, model) -> dict[str, torch.Tensor]:
        return dict(self.bridges[id(model)].export_weights([model]))


# ---------------------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------------------

def gather_from_tensor_model_parallel_region(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocab logits from the TP ranks' vocab shards (megatron-core's gather; the tensor itself at
    TP=1)."""
    from megatron.core import tensor_parallel

    return tensor_parallel.gather_from_tensor_model_parallel_region(logits)


def exactness(side, path: Path, hf_state: dict[str, torch.Tensor], hf_logits: torch.Tensor,
              tokens: torch.Tensor) -> dict[str, Any]:
    """``{"ok", "bitwise", "tensors", "logits_diff", "error"}`` of one bridge on one HF folder."""
    try:
        model = side.build_and_load(path)
        out = side.export(model)
        with torch.no_grad():
            logits = model(input_ids=tokens, position_ids=torch.arange(tokens.shape[1]).expand_as(tokens),
                           attention_mask=None)
            logits = gather_from_tensor_model_parallel_region(logits)  # vocab-parallel at TP > 1
    except Exception as e:  # noqa: BLE001 - a refusal or a crash is the measurement
        return dict(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:90]}")
    same_names = sorted(out) == sorted(hf_state)
    equal = same_names and all(torch.equal(out[k], v) and out[k].dtype == v.dtype
                               for k, v in hf_state.items())
    diff = float((logits[..., : hf_logits.shape[-1]] - hf_logits).abs().max())
    return dict(ok=True, bitwise=equal, tensors=len(out), names=same_names, logits_diff=diff)


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def speed(sides: list, path: Path, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Seconds per side and repeat: ``load`` (HF folder -> model), ``export`` (every HF tensor into a dict, as
    the bridge yields it) and ``export_copies`` (the same with each tensor a fresh copy: hpcrl's export yields
    fresh tensors, so this is its ``export``; mbridge's yields views of the parameters where no layout change
    is needed, so its tensors are ``.clone()``d). The sides alternate within each repeat, the first one
    swapping from repeat to repeat."""
    import gc

    models = {s.name: s.build_and_load(path) for s in sides}
    times: dict[str, dict[str, list[float]]] = {s.name: {"load": [], "export": [], "export_copies": []}
                                                 for s in sides}
    for r in range(repeats):
        for s in (sides if r % 2 == 0 else sides[::-1]):
            m, t = models[s.name], times[s.name]
            gc.collect()
            t["load"].append(timed(lambda: s.load(m, path)))
            t["export"].append(timed(lambda: s.export(m)))
            if s.name == "hpcrl":
                t["export_copies"].append(t["export"][-1])
            else:
                t["export_copies"].append(timed(lambda: {k: v.clone() for k, v in s.export(m).items()}))
    return times


def line_counts(paths: list[Path]) -> tuple[int, int]:
    """(physical lines, code lines) of Python files: code lines leave out blank lines, comment-only lines and
    docstrings."""
    physical = code = 0
    for path in paths:
        text = path.read_text()
        lines = text.splitlines()
        doc_lines: set[int] = set()
        for node in ast.walk(ast.parse(text)):
            scopes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
            if isinstance(node, scopes) and node.body:
                first = node.body[0]
                if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                        and isinstance(first.value.value, str):
                    doc_lines.update(range(first.lineno, first.end_lineno + 1))
        physical += len(lines)
        code += sum(1 for i, line in enumerate(lines, 1)
                    if line.strip() and not line.strip().startswith("#") and i not in doc_lines)
    return physical, code


def source_lines(fn: Callable) -> int:
    return len(inspect.getsource(fn).splitlines())


def loc_rows(mbridge_dir: Optional[Path]) -> list[tuple[str, str, tuple[int, int]]]:
    """``(side, what, (physical, code))`` for each side's mapping code, per part."""
    train = ROOT / "hpcrl" / "train"
    own = [train / "bridge.py", train / "hf_config.py"]
    # the new families' own modules: GLM-4.5 / DeepSeek-V3 router, MLA config and names, MLA's megatron layers
    extra = [p for p in (train / "deepseek_moe.py", train / "mla.py", train / "mla_layers.py") if p.exists()]
    rows = [("hpcrl", "bridge.py + hf_config.py (every family: names, layouts, TP/EP/ETP, config, refusals)",
             line_counts(own))]
    if extra:
        rows.append(("hpcrl", " + ".join(p.name for p in extra) + " (new families)", line_counts(extra)))
    if mbridge_dir is not None:
        core_files = ("bridge.py", "llm_bridge.py", "util.py", "parallel_states.py", "safetensor_io.py",
                      "auto_bridge.py")
        core = [mbridge_dir / "core" / f for f in core_files]
        models = mbridge_dir / "models"
        rows += [
            ("mbridge", "generic core (core/: bridge, llm_bridge, util, parallel_states, safetensor_io, "
                        "auto_bridge)",
             line_counts(core)),
            ("mbridge", "qwen3_moe (models/qwen3moe.py + qwen2moe.py it extends)",
             line_counts([models / "qwen3moe.py", models / "qwen2moe.py"])),
            ("mbridge", "glm4_moe (models/glm4moe.py + qwen2.py + utils/layer.py it uses)",
             line_counts([models / "glm4moe.py", models / "qwen2.py", mbridge_dir / "utils" / "layer.py"])),
            ("mbridge", "deepseek_v3 (models/deepseek_v3.py + ext/deepseek_v3 FP8 reader)",
             line_counts([models / "deepseek_v3.py",
                          *sorted((models / "ext" / "deepseek_v3").glob("*.py"))])),
        ]
    return rows


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--no-speed", action="store_true", help="exactness, patches and lines of code only")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (> 1: run under torchrun; "
                                                          "exactness only)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (> 1: run under torchrun; "
                                                          "exactness only)")
    args = parser.parse_args(argv)
    distributed = args.tp * args.ep > 1
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)

    from hpcrl.train import parallel

    # gloo (a world of 1, or torchrun's); applies hpcrl.train.cpu_compat (both bridges need it)
    parallel.init_distributed(timeout_s=300)
    parallel.initialize_model_parallel(tp=args.tp, ep=args.ep)
    rank0 = torch.distributed.get_rank() == 0
    if distributed and not rank0:
        sys.stdout = io.StringIO()  # rank 0 prints; every rank measures (each export is a collective)
    parallel.model_parallel_cuda_manual_seed(1234)
    sides: list = [HpcrlSide()]
    mbridge_dir = None
    try:
        sides.append(MbridgeSide())
        fixed = MbridgeSide(fix_config=True)
        mbridge_dir = Path(sys.modules["mbridge"].__file__).parent
        mb_label = f"mbridge {sides[1].version}"
    except ImportError as e:
        mb_label = None
        print(f"# mbridge not importable ({e}): its rows are skipped. Install it with `python -m pip install "
              "--no-deps --target DIR mbridge==0.15.1` and add DIR to PYTHONPATH.")

    import megatron.core
    import transformers
    from transformers import AutoModelForCausalLM

    print(machine_header(threads=args.threads, precision="float32"))
    print(f"# megatron-core {megatron.core.__version__}, transformers {transformers.__version__}"
          + (f", {mb_label}" if mb_label else "") + f", TP={args.tp}, EP={args.ep}, local layer spec, gloo "
          f"world of {torch.distributed.get_world_size()}")
    print("\n| family | bridge | builds and loads | export bitwise (tensors) "
          "| logits max abs diff vs HF fp32 |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as own_tmp:
        shared = [own_tmp]
        torch.distributed.broadcast_object_list(shared, src=0)  # rank 0's folder holds every rank's models
        tmp = shared[0]
        for family in args.families:
            model_type, fields = FAMILIES[family]
            path = make_hf(model_type, fields, Path(tmp) / re.sub(r"\W", "_", family))
            hf_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
            tokens = torch.randint(0, COMMON["vocab_size"], (2, 12),
                                   generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                hf_logits = hf_model(tokens).logits
            from hpcrl.train.bridge import read_hf_state_dict

            hf_state = read_hf_state_dict(path)
            hf_config = hf_model.config
            for side in sides + ([fixed] if mb_label and config_fixes(hf_config) else []):
                r = exactness(side, path, hf_state, hf_logits, tokens)
                if r["ok"]:
                    bitwise = "yes" if r["bitwise"] else "NO"
                    print(f"| {family} | {side.name} | yes | {bitwise} ({r['tensors']}) | "
                          f"{r['logits_diff']:.1e} |")
                else:
                    print(f"| {family} | {side.name} | no: {r['error']} | - | - |")

        if distributed:  # exactness only; what follows does not depend on the parallel layout
            args.no_speed, mb_label, mbridge_dir = True, None, None
        if mb_label:
            print("\n| mbridge patch (this file) | for | lines |")
            print("|---|---|---|")
            for fn, scope, what in PATCHES:
                lines = source_lines(fn)
                if fn is patch_mla_core_attention:
                    lines += source_lines(MLACoreAttention)
                print(f"| {fn.__name__}: {what} | {scope} | {lines} |")
            print("| (configuration: cpu_overrides, through set_extra_args) | all | "
                  f"{source_lines(cpu_overrides)} |")

        if not distributed:
            print("\n| side | mapping code | physical lines | code lines |")
            print("|---|---|---|---|")
            for side, what, (physical, code) in loc_rows(mbridge_dir):
                print(f"| {side} | {what} | {physical} | {code} |")

        if not args.no_speed:
            model_type, fields = SPEED_MODEL
            path = make_hf(model_type, fields, Path(tmp) / "speed")
            n = sum(t.numel() for t in read_hf_state_dict(path).values())
            times = speed(sides, path, args.repeats)
            print(f"\nspeed: {model_type} {n / 1e6:.1f}M parameters (hidden {fields['hidden_size']}, "
                  f"{fields['num_hidden_layers']} layers, {fields['num_experts']} experts), {args.repeats} "
                  "repeats, the bridges alternating; seconds best / median")
            print("\n| bridge | load s | export s (as yielded) | export s (fresh copies) |")
            print("|---|---|---|---|")
            stats = {name: {k: (min(v), statistics.median(v)) for k, v in row.items()}
                     for name, row in times.items()}
            for name, row in stats.items():
                print(f"| {name} | " + " | ".join(f"{row[k][0]:.3f} / {row[k][1]:.3f}"
                                                  for k in ("load", "export", "export_copies")) + " |")
            if mb_label:
                h, m = stats["hpcrl"], stats["mbridge"]
                ratios = (f"{m[k][0] / h[k][0]:.2f}x / {m[k][1] / h[k][1]:.2f}x"
                          for k in ("load", "export", "export_copies"))
                print("| mbridge / hpcrl | " + " | ".join(ratios) + " |")
        torch.distributed.barrier()  # rank 0 removes the folder on leaving
    parallel.destroy()


if __name__ == "__main__":
    main()
