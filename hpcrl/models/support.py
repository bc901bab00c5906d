"""What the trainer can build, told from a model folder's files alone: no torch, no transformers, no tensor
read.

:func:`unsupported_feature` reads a ``config.json`` (a dict) and names the first field the Megatron bridge
(:mod:`hpcrl.train.bridge`) cannot express; the bridge calls it too, so the login node and the run refuse
the same models with the same words. :func:`check_model_folder` adds what a folder needs to load: a
``config.json`` that parses, and safetensors files whose headers parse and whose sizes cover every tensor (a
truncated download, a folder without weights), checked from the 8-byte length and JSON header of each file.

Fields are read where transformers 5 puts them and where hub checkpoints do: RoPE settings in
``rope_parameters`` (transformers 5) or ``rope_scaling`` / the top level (older and published configs).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Mapping, Optional

from hpcrl.models.hf import SUPPORTED_MODEL_TYPES as _FAMILIES  # stdlib-only module: no torch here either
from hpcrl.train import mla  # its config checks are stdlib-only too

SUPPORTED_MODEL_TYPES = tuple(_FAMILIES)
"""HF ``model_type`` values the trainer builds: those of :data:`hpcrl.models.hf.SUPPORTED_MODEL_TYPES`."""

LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""The only Llama-3 RoPE scaling the bridge expresses (Megatron's fixed constants)."""

_GATED_DELTA_NET = ("is not trainable here: its linear-attention layers need megatron-core's gated delta-net, "
                    "whose kernels (fla) run on CUDA only and have no CPU path; hpcrl does not build it yet")
_SPARSE_ATTENTION = ("is not trainable here: DeepSeek sparse attention (the lightning indexer) is not built by "
                     "hpcrl's bridge; its dense sibling (deepseek_v3 / glm4_moe) is")
NOT_BUILDABLE = {
    "qwen3_next": _GATED_DELTA_NET, "qwen3_5_text": _GATED_DELTA_NET, "qwen3_5_moe_text": _GATED_DELTA_NET,
    "glm_moe_dsa": _SPARSE_ATTENTION, "deepseek_v32": _SPARSE_ATTENTION,
}
"""Known families the trainer cannot build, with the reason (the issue's stretch list: Qwen3-Next / Qwen3.5
text models, GLM-5 / DeepSeek-V3.2 sparse attention)."""

Problem = tuple[str, Any, str]
"""``(config.json field, its value, what is wrong and what is supported)``."""


def rope_settings(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE parameters of a config: ``rope_parameters`` (transformers 5), else ``rope_scaling``, plus a
    top-level ``partial_rotary_factor`` (published GLM configs) when the dict has none."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if "partial_rotary_factor" not in params and hf.get("partial_rotary_factor") is not None:
        params["partial_rotary_factor"] = hf["partial_rotary_factor"]
    return params


def unsupported_feature(hf: Mapping[str, Any]) -> Optional[Problem]:
    """The first setting of ``config.json`` (``hf``) the trainer cannot build, or None.

    Refused: a ``model_type`` outside :data:`SUPPORTED_MODEL_TYPES`; ``hidden_act`` other than silu; q/k/v
    bias except Qwen2's and GLM-4.5's; MLP bias; Qwen2's sliding-window attention (``use_sliding_window``;
    Mistral's and Mixtral's ``sliding_window`` is built, in the padded and the packed forward); RoPE scalings
    other than plain and Llama-3's standard one; partial RoPE except GLM-4.5's; Qwen3-MoE with dense layers or
    shared experts; GLM-4.5 routers megatron-core cannot express (:func:`deepseek_router_problem`); Mixtral's
    ``router_jitter_noise`` (HF's training-time noise on the MoE input).
    """
    model_type = hf.get("model_type")
    if model_type in NOT_BUILDABLE:
        return ("model_type", model_type, NOT_BUILDABLE[model_type])
    if model_type not in SUPPORTED_MODEL_TYPES:
        return ("model_type", model_type,
                f"is not a family hpcrl trains; it trains {', '.join(SUPPORTED_MODEL_TYPES)}")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        return ("hidden_act", act, "is not supported (SwiGLU with silu is)")
    if model_type not in ("qwen2", "glm4_moe") and hf.get("attention_bias"):
        return ("attention_bias", True, f"(bias on q/k/v and o_proj) is not supported for {model_type}")
    if hf.get("mlp_bias"):
        return ("mlp_bias", True, "is not supported")
    if hf.get("use_sliding_window"):  # Qwen2's switch; Mistral's and Mixtral's sliding_window is built
        return ("use_sliding_window", True, "sliding-window attention is not supported")
    if model_type == "mixtral" and float(hf.get("router_jitter_noise") or 0.0) != 0.0:
        return ("router_jitter_noise", hf["router_jitter_noise"],
                "is not supported: HF multiplies the MoE input by random noise in training (Megatron's "
                "moe_input_jitter_eps jitters the router input only); set router_jitter_noise: 0.0")
    rope = rope_settings(hf)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if mla.is_mla(hf):  # multi-latent attention: plain RoPE or YaRN (hpcrl.train.mla)
        bad = mla.unsupported_feature(hf, rope)
        if bad is not None:
            return bad
        kind = "default"
        if not mla.all_layers_dense(hf):  # MoE layers: the DeepSeek-style router, as GLM-4.5's
            bad = deepseek_router_problem(hf)
            if bad is not None:
                return bad
    if kind not in ("default", None):
        standard = kind == "llama3" and all(float(rope.get(k, -1)) == v for k, v in LLAMA3_ROPE.items())
        if not standard:
            return ("rope_parameters", rope, f"RoPE scaling {kind!r} is not supported (plain RoPE, or llama3 "
                    f"with {LLAMA3_ROPE}, is)")
    partial = rope.get("partial_rotary_factor")
    if partial is not None and float(partial) != 1.0 and model_type != "glm4_moe":
        return ("partial_rotary_factor", partial, "partial RoPE is not supported (RoPE on the whole head is)")
    if model_type == "qwen3_moe":
        if list(hf.get("mlp_only_layers") or []):
            return ("mlp_only_layers", hf["mlp_only_layers"],
                    "dense layers between MoE layers are not supported: every layer must be MoE")
        if int(hf.get("decoder_sparse_step", 1) or 1) != 1:
            return ("decoder_sparse_step", hf["decoder_sparse_step"],
                    "dense layers between MoE layers are not supported: every layer must be MoE (step 1)")
        if hf.get("shared_expert_intermediate_size"):
            return ("shared_expert_intermediate_size", hf["shared_expert_intermediate_size"],
                    "shared experts are not supported")
    if model_type == "glm4_moe":
        return deepseek_router_problem(hf)
    return None


def deepseek_router_problem(hf: Mapping[str, Any]) -> Optional[Problem]:
    """What of a GLM-4.5 / DeepSeek-V3-style router (sigmoid scores, ``e_score_correction_bias``, groups)
    megatron-core 0.16.1 cannot express, or None.

    Megatron picks ``topk_group`` of ``n_group`` groups by the sum of each group's top ``top_k // topk_group``
    scores, HF's ``Glm4MoeTopkRouter`` / ``DeepseekV3TopkRouter`` by its top 2: refused where they differ
    (``n_group > 1`` and ``num_experts_per_tok // topk_group != 2``). Megatron always renormalises the top-k
    sigmoid scores (k > 1), so ``norm_topk_prob: false`` is refused; so are scorings other than sigmoid.
    """
    experts = int(hf.get("n_routed_experts") or 0)
    top_k = int(hf.get("num_experts_per_tok") or 0)
    groups, topk_group = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    scoring = hf.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        return ("scoring_func", scoring, "is not supported (sigmoid, as GLM-4.5 and DeepSeek-V3, is)")
    if hf.get("topk_method", "noaux_tc") != "noaux_tc":
        return ("topk_method", hf["topk_method"],
                "is not supported (noaux_tc: sigmoid + e_score_correction_bias, is)")
    if not hf.get("norm_topk_prob", True) and top_k > 1:
        return ("norm_topk_prob", False, "is not supported: megatron-core renormalises the top-k sigmoid "
                "scores (norm_topk_prob: true is supported)")
    if experts <= 0 or top_k <= 0 or top_k > experts:
        return ("num_experts_per_tok", top_k, f"must be between 1 and n_routed_experts={experts}")
    if int(hf.get("n_shared_experts", 1) or 0) < 1:
        return ("n_shared_experts", hf.get("n_shared_experts"),
                "is not supported (1 or more shared experts is)")
    if groups > 1:
        if experts % groups or topk_group > groups or top_k // max(topk_group, 1) != 2:
            return ("n_group", groups, f"with topk_group={topk_group}, num_experts_per_tok={top_k}, "
                    f"n_routed_experts={experts}: megatron-core scores a group by its top "
                    "num_experts_per_tok // topk_group experts, HF by its top 2; supported: n_group=1, or "
                    "n_group dividing n_routed_experts with num_experts_per_tok // topk_group == 2")
    return None


def _safetensors_problem(path: Path) -> Optional[str]:
    """What is wrong with one safetensors file, from its header and size; None when it can be loaded."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                return f"{path.name} is {size} bytes, too short for a safetensors header"
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8 or n > 100 * 1024 * 1024:
                return f"{path.name}: its header claims {n} bytes, more than the file holds ({size} bytes)"
            header = json.loads(f.read(n))
    except OSError as e:
        return f"{path.name} cannot be read ({e.strerror or type(e).__name__})"
    except ValueError:
        return f"{path.name}: its header is not valid JSON (truncated or not safetensors)"
    if not isinstance(header, dict):
        return f"{path.name}: its header is not a JSON object"
    end = max((int(v["data_offsets"][1]) for k, v in header.items()
               if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v), default=0)
    if 8 + n + end > size:
        return (f"{path.name} is truncated: its tensors need {8 + n + end} bytes, the file has {size} (an "
                "interrupted download or copy?)")
    return None


INDEX = "model.safetensors.index.json"
"""The index of a sharded HF checkpoint (``weight_map``: tensor name -> shard file)."""


class NoWeightsError(FileNotFoundError):
    """An HF folder with neither a safetensors index nor a ``*.safetensors`` file."""


def weight_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of the HF folder ``path``: the shards :data:`INDEX` names (sorted, each once;
    not checked to exist), else every ``*.safetensors`` in it. Raises ValueError when the index has no
    readable ``weight_map``, OSError when it cannot be read, :class:`NoWeightsError` (a FileNotFoundError)
    when the folder has neither an index nor a safetensors file."""
    path = Path(path)
    index = path / INDEX
    if index.is_file():
        try:
            return [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        except (KeyError, AttributeError, TypeError) as e:
            raise ValueError(f"{index}: no readable weight_map") from e
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise NoWeightsError(f"no *.safetensors in {path}")
    return files


def check_model_folder(path: str | os.PathLike, weights: bool = True) -> Optional[tuple[str, str]]:
    """What keeps the HF folder ``path`` from being trained: ``(problem, fix)``, or None when it can.

    Checks that ``config.json`` parses, :func:`unsupported_feature`, and (with ``weights``) the weights:
    ``model.safetensors`` or the shards of ``model.safetensors.index.json`` exist and each file's header and
    size cover its tensors. Reads headers only (bytes, not tensors). ``weights=False``: a layout planned
    before the weights are downloaded (``hpcrl validate --plan``).
    """
    path = Path(path)
    try:
        hf = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except OSError as e:
        return f"config.json cannot be read ({e.strerror or type(e).__name__})", "check the folder"
    except ValueError as e:
        return (f"config.json is not valid JSON ({e})".replace("\n", " "),
                "fix or re-download the model's config.json")
    if not isinstance(hf, dict):
        return "config.json is not a JSON object", "fix or re-download the model's config.json"
    bad = unsupported_feature(hf)
    if bad is not None:
        field, value, what = bad
        return f"config.json {field}={value!r} {what}", "train a supported model (docs/architecture.md)"
    if not weights:
        return None
    try:
        shards = weight_files(path)
    except NoWeightsError:
        return ("no weights (no *.safetensors file)",
                "download the model's safetensors weights into the folder")
    except (OSError, ValueError):
        return f"{INDEX} has no readable weight_map", "fix or re-download the model's index file"
    missing = [str(f.relative_to(path)) for f in shards if not f.is_file()]
    if missing:
        return (f"{INDEX} names {len(missing)} missing shard(s), e.g. {missing[0]}",
                "download every shard of the model")
    for shard in shards:
        problem = _safetensors_problem(shard)
        if problem is not None:
            return problem, "re-download or re-copy the model's weights"
    return None


def routed_experts(hf: Mapping[str, Any]) -> int:
    """Routed experts per MoE layer of a ``config.json``: ``num_experts`` (Qwen-MoE), ``num_local_experts``
    (Mixtral, transformers 5) or ``n_routed_experts`` (GLM-4.5, DeepSeek-V3); 0 for a dense model."""
    return int(hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts") or 0)
