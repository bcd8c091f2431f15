"""Every architecture transformers ships, built tiny from its config, for the survey by enumeration (issue 47).

:func:`architectures` walks transformers' auto-model mappings (:data:`TASKS`: causal LM, sequence
classification, seq2seq LM, image and audio classification) and lists every (model type, task, class).
:func:`tiny_config` shrinks the type's default config generically — the common size fields (hidden sizes,
layers, heads, intermediate sizes, vocabulary, positions, experts, image/patch size, audio convolutions),
in nested sub-configs too, every dropout to 0 — with :data:`OVERRIDES` only where the generic shrinking
fails.  :func:`build_case` builds the model (float64, train mode) and a batch of its task (token ids,
images or audio found by probing the model with candidate shapes) as a :class:`hf_architectures.Case`,
or raises :class:`NotBuilt` with the reason ("not built" is the harness's outcome, never the engine's).

:func:`survey_one` runs one (type, task): per condition of :data:`CONDITIONS` (T ≠ B, T = B, a padded
batch with its attention mask) the float64 one-backward-per-example reference of
:func:`hf_architectures.reference`, the per-example-loss independence test (:func:`independence`), then
each mode of :data:`hf_architectures.MODES` (:func:`hf_architectures.check_case`).  The runner that
forks one process per architecture, the resumable results and the table: ``bench/survey_architectures.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time

import torch

import hf_architectures as hf

TASKS = {  # task → the auto-model mapping of transformers.models.auto.modeling_auto
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "seq-cls": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "image-cls": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "audio-cls": "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
}
TEXT_TASKS = ("causal-lm", "seq-cls", "seq2seq")
# condition → (B, T); "mask": the T != B batch right-padded (example i has T - i mod 3 tokens), its pads masked
CONDITIONS = {"T!=B": (3, 7), "T=B": (5, 5), "mask": (3, 7)}
MAX_PARAMETERS = 3_000_000  # a config the shrinking missed (counted on the meta device, before building)
V = 97  # vocabulary; token ids are drawn from [3, FIRST_SPECIAL), special tokens above
FIRST_SPECIAL = 90

HIDDEN, FFN, HEADS, HEAD_DIM, LAYERS = 32, 64, 2, 16, 2
SIZES = {  # field → its tiny value (applied where the default is an int)
    **dict.fromkeys(
        ("hidden_size", "d_model", "n_embd", "word_embed_proj_dim", "model_dim", "output_hidden_size"), HIDDEN
    ),
    **dict.fromkeys(("dim", "embed_dim", "text_embed_dim", "vision_embed_dim", "d_embed"), HIDDEN),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "n_inner"), FFN),
    **dict.fromkeys(("hidden_dim", "ffn_hidden_size", "d_inner", "mlp_dim", "intermediate_dim"), FFN),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"), 16),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads"), HEADS),
    **dict.fromkeys(("encoder_attention_heads", "decoder_attention_heads", "num_attention_heads_per_layer"), HEADS),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"), 1),
    **dict.fromkeys(
        ("head_dim", "d_kv", "kv_channels", "attention_head_size", "qk_nope_head_dim", "v_head_dim"), HEAD_DIM
    ),
    **dict.fromkeys(("qk_rope_head_dim", "rotary_dim"), 8),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank", "projection_dim", "embedding_size", "classifier_proj_size"), 16),
    **dict.fromkeys(("codevector_dim", "proj_codevector_dim", "xvector_output_dim"), 16),
    **dict.fromkeys(("pooler_hidden_size", "emb_dim"), HIDDEN),
    **dict.fromkeys(("src_vocab_size", "tgt_vocab_size"), V),
    **dict.fromkeys(("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers"), LAYERS),
    **dict.fromkeys(("decoder_layers", "num_decoder_layers", "num_encoder_layers", "text_layers"), LAYERS),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length"), 64),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts", "moe_k"), 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "first_k_dense_replace", "n_group", "topk_group"), 1),
    **dict.fromkeys(("mamba_n_groups", "n_groups"), 1),
    "mamba_n_heads": 4,  # × mamba_d_head 16 = mamba_expand 2 × hidden 32
    **dict.fromkeys(("mamba_d_state", "ssm_state_size", "state_size", "mamba_d_head", "linear_key_head_dim"), 16),
    **dict.fromkeys(("linear_value_head_dim", "time_step_rank", "mamba_chunk_size", "chunk_size"), 16),
    **dict.fromkeys(("linear_num_key_heads", "linear_num_value_heads"), HEADS),
    "num_groups": 4,  # GroupNorm groups: divide the tiny channel counts
    "conv_kernel": 4,  # (an int: mamba's causal convolution; wav2vec2's list of kernels is left as it is)
    "num_conv_pos_embeddings": 16,
    "num_conv_pos_embedding_groups": 2,
    "image_size": 32,
    "patch_size": 4,
    "window_size": 2,
    "num_mel_bins": 16,
    "relative_attention_num_buckets": 8,
    "position_buckets": 8,
    "max_relative_positions": 16,
}
LIST_SIZES = {  # list field → its tiny list (same length), from the index i and the length n
    "depths": lambda i, n: 1,
    "hidden_sizes": lambda i, n: 16 * 2 ** min(i, 2),
    "embed_dims": lambda i, n: 16 * 2 ** min(i, 2),
    "embed_dim": lambda i, n: 16 * 2 ** min(i, 2),
    "depth": lambda i, n: 1,
    "dims": lambda i, n: 16 * 2 ** min(i, 2),
    "num_heads": lambda i, n: HEADS,
    "conv_dim": lambda i, n: 16,
    "tdnn_dim": lambda i, n: 16,
    "num_attention_heads": lambda i, n: HEADS,
    "image_size": lambda i, n: 32,
    "patch_size": lambda i, n: 4,
}
# per model type: config fields set after the generic shrinking, only where it fails (a comment says why)
OVERRIDES: dict[str, dict] = {
    "whisper": {"max_source_positions": 8, "num_mel_bins": 8},  # the encoder takes exactly 2 × max_source frames
    "diffllama": {"num_key_value_heads": 2},
    # the fixed list's Swin (tests/hf_architectures.py): two stages, windows of 2 patches on an 8 × 8 image
    "swin": {
        "image_size": 8,
        "patch_size": 2,
        "embed_dim": 16,
        "depths": [1, 1],
        "num_heads": [2, 2],
        "window_size": 2,
    },  # its differential attention splits the values along 2 KV heads
}


RANDOM_IN_TRAINING = ("dropout", "pdrop", "drop_prob", "drop_path", "layerdrop", "drop_rate", "mask_time_prob")
RANDOM_IN_TRAINING += ("mask_feature_prob", "jitter")


class NotBuilt(Exception):
    """The architecture cannot be built tiny here (the harness's outcome, not the engine's)."""


def architectures(tasks=tuple(TASKS)) -> list[tuple[str, str, str]]:
    """(model type, task, model class name) of every architecture of the auto-model mappings, sorted."""
    from transformers.models.auto import modeling_auto

    out = []
    for task in tasks:
        for model_type, cls in getattr(modeling_auto, TASKS[task]).items():
            out.append((model_type, task, cls[0] if isinstance(cls, (list, tuple)) else cls))
    return sorted(out)


def key(model_type: str, task: str) -> str:
    """The file-safe name of one (type, task): ``gpt2__causal-lm``."""
    return f"{model_type}__{task}"


def _shrink(d: dict, layers_before: int | None = None) -> dict:
    """The config dict ``d`` with its size fields tiny, dropouts 0, recursively (sub-configs)."""
    layers_before = next(
        (d[k] for k in ("num_hidden_layers", "num_layers", "n_layer", "n_layers") if isinstance(d.get(k), int)),
        layers_before,
    )
    out = {}
    for k, v in d.items():
        if k in ("id2label", "label2id"):
            continue
        if isinstance(v, dict):
            out[k] = _shrink(v, layers_before)
        elif isinstance(v, bool) or v is None or isinstance(v, str):
            out[k] = v
        elif any(word in k for word in RANDOM_IN_TRAINING) and isinstance(v, (int, float)):
            out[k] = type(v)(
                0
            )  # dropout, stochastic depth, spec augment, router jitter: off (a deterministic reference)
        elif k == "vocab_size" and isinstance(v, int):
            out[k] = min(v, V)
        elif isinstance(v, int) and k in SIZES:
            out[k] = min(v, SIZES[k])
        elif isinstance(v, list) and k in LIST_SIZES and all(isinstance(x, int) for x in v):
            out[k] = [LIST_SIZES[k](i, len(v)) for i in range(len(v))]
        elif isinstance(v, list) and layers_before and len(v) == layers_before and layers_before > LAYERS:
            out[k] = v[:LAYERS]  # per-layer lists (layer types, sliding windows ...) follow the layer count
        else:
            out[k] = v
    for k, v in list(out.items()):  # per-layer settings keyed by layer index: the tiny model's layers only
        if isinstance(v, dict) and v and all(str(i).isdigit() for i in v):
            out[k] = {i: x for i, x in v.items() if int(i) < LAYERS}
    for k in ("out_features", "out_indices", "stage_names"):  # backbone outputs: derived again from the depths
        out.pop(k, None)
    if isinstance(out.get("qk_rope_head_dim"), int) and isinstance(out.get("qk_nope_head_dim"), int):
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]  # multi-head latent attention
        if isinstance(out.get("head_dim"), int):
            out["head_dim"] = out["qk_rope_head_dim"]
        if isinstance(out.get("num_key_value_heads"), int):
            out["num_key_value_heads"] = out.get("num_attention_heads", HEADS)  # one key/value head per query head
    return _tokens(out)


def _tokens(d: dict) -> dict:
    """Special token ids inside the tiny vocabulary: pad 1, bos 0, eos 2, others from :data:`FIRST_SPECIAL` up."""
    fixed = {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "decoder_start_token_id": 0}
    spare = iter(range(FIRST_SPECIAL, V))
    for k, v in list(d.items()):
        if k in fixed and (v is None or isinstance(v, (int, list))):
            if k == "pad_token_id" or v is not None:
                d[k] = fixed[k]
        elif k.endswith(("_token_id", "_token_index")) and isinstance(v, int) and v >= FIRST_SPECIAL:
            d[k] = next(spare, V - 1)
    return d


def tiny_config(model_type: str):
    """The type's default config shrunk (:func:`_shrink`), with :data:`OVERRIDES`, 3 labels, no cache, eager
    attention and experts (float64 on CPU)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    try:
        default = cls()
    except Exception as exc:
        raise NotBuilt(f"default config: {hf._first_line(exc, 160)}") from exc
    small = _shrink(default.to_dict())
    small.update(OVERRIDES.get(model_type, {}))
    small.update(num_labels=hf.LABELS, use_cache=False)
    small.setdefault("decoder_start_token_id", 0)  # seq2seq models shift the labels right from it
    if "apply_spec_augment" in small:
        small["apply_spec_augment"] = False
    try:
        config = cls.from_dict(small)
    except Exception as exc:
        raise NotBuilt(f"tiny config: {hf._first_line(exc, 160)}") from exc
    for c in [config, *(getattr(config, k) for k in vars(config) if hasattr(getattr(config, k), "to_dict"))]:
        for name, value in (("_attn_implementation", "eager"), ("_experts_implementation", "eager")):
            with contextlib.suppress(Exception):
                setattr(c, name, value)
        if hasattr(c, "experts_implementation"):
            c.experts_implementation = "eager"
    return config


def _model(class_name: str, config):
    import transformers

    cls = getattr(transformers, class_name, None)
    if cls is None:
        raise NotBuilt(f"{class_name} is not importable (an extra package)")
    try:
        with torch.device("meta"):
            n = sum(p.numel() for p in cls(config).parameters())
    except Exception as exc:
        raise NotBuilt(f"model: {hf._first_line(exc, 200)}") from exc
    if n > MAX_PARAMETERS:
        raise NotBuilt(f"{n / 1e6:.0f}M parameters after shrinking (a size field the shrinking misses)")
    torch.manual_seed(0)
    try:
        return cls(config).to(torch.float64).train(), n
    except Exception as exc:
        raise NotBuilt(f"model: {hf._first_line(exc, 200)}") from exc


def _accepts(model, name: str) -> bool:
    params = inspect.signature(model.forward).parameters
    return name in params


def _ids(B, T, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, FIRST_SPECIAL, (B, T), generator=g)


def _sub(config, *names):
    """The first of ``names`` in ``config`` or in its vision / audio sub-config."""
    for c in (config, getattr(config, "vision_config", None), getattr(config, "audio_config", None)):
        for n in names:
            v = getattr(c, n, None) if c is not None else None
            if v is not None:
                return v
    return None


def _audio_length(config, frames: int) -> int:
    """Raw audio samples that the feature encoder's convolutions (kernels, strides) turn into ``frames``."""
    n = frames
    for k, s in reversed(list(zip(config.conv_kernel, config.conv_stride, strict=False))):
        n = (n - 1) * s + k
    return n


def _candidates(model, config, task, B, g):
    """Candidate inputs (keyword → tensor of B rows) of an image or audio model, the likeliest first."""
    name = getattr(model, "main_input_name", "input_values")
    if task == "image-cls":
        size = _sub(config, "image_size") or 32
        size = size if isinstance(size, (list, tuple)) else (size, size)
        ch = _sub(config, "num_channels") or 3
        for s in (tuple(size), (32, 32), (64, 64), (224, 224)):
            yield {name: torch.randn((B, ch, *s), generator=g, dtype=torch.float64)}
        return
    mel = _sub(config, "num_mel_bins", "feature_size", "input_feat_per_channel") or 16
    if getattr(config, "conv_kernel", None) is not None and name == "input_values":
        yield {name: torch.randn((B, _audio_length(config, 7)), generator=g, dtype=torch.float64)}
    frames = 2 * getattr(config, "max_source_positions", 8) if name == "input_features" else None
    for T in [t for t in (frames, 16, getattr(config, "max_length", None), 64, 128) if t]:
        yield {name: torch.randn((B, mel, T), generator=g, dtype=torch.float64)}
        yield {name: torch.randn((B, T, mel), generator=g, dtype=torch.float64)}
    yield {name: torch.randn((B, 4000), generator=g, dtype=torch.float64)}


def _probe(model, config, task, B):
    """The first candidate input the model runs on (no gradients), or NotBuilt with the last error."""
    g = torch.Generator().manual_seed(1)
    error = None
    for inputs in _candidates(model, config, task, B, g):
        try:
            with torch.no_grad():
                model(**inputs)
            return inputs
        except Exception as exc:
            error = exc
    raise NotBuilt(f"no input shape runs: {hf._first_line(error, 200)}")


def _seq(model, inputs) -> int | None:
    """The length of the first hidden state's token (or last spatial) dimension: the T of a vision/audio model."""
    try:
        with torch.no_grad():
            out = model(**{k: v[:1] for k, v in inputs.items()}, output_hidden_states=True)
        h = out.hidden_states[0]
        return h.shape[1] if h.dim() == 3 else h.shape[-1]
    except Exception:
        return None


@dataclasses.dataclass
class Built:
    model: torch.nn.Module
    config: object
    parameters: int
    seq: int | None  # vision / audio: the tokens of the first hidden state (T of the T = B condition)
    template: dict | None  # vision / audio: one probed input of B = 1 rows


def build_model(model_type: str, task: str, class_name: str) -> Built:
    """The tiny model (float64, train mode) and, for images and audio, a probed input (NotBuilt: why not)."""
    hf._tf()
    config = tiny_config(model_type)
    model, n = _model(class_name, config)
    if task in TEXT_TASKS:
        return Built(model, config, n, None, None)
    template = _probe(model, config, task, 1)
    return Built(model, config, n, _seq(model, template), template)


def build_case(built: Built, task: str, condition: str) -> hf.Case | None:
    """The case of one condition (None: not applicable, e.g. a mask for an image model)."""
    B, T = CONDITIONS[condition]
    model = built.model
    if task in TEXT_TASKS:
        ids = _ids(B, T)
        inputs = {"input_ids": ids}
        if condition == "mask":
            if not _accepts(model, "attention_mask"):
                return None
            mask = hf.padding_mask(B, T)
            inputs = {"input_ids": ids.masked_fill(mask == 0, 1), "attention_mask": mask}
        if task == "causal-lm":
            return hf.Case(model, inputs, hf._lm_loss, T)
        if task == "seq-cls":  # each example ends with eos (encoder-decoders classify from its hidden state)
            last = inputs["attention_mask"].sum(1) - 1 if condition == "mask" else torch.full((B,), T - 1)
            inputs["input_ids"] = inputs["input_ids"].index_put((torch.arange(B), last), torch.tensor(2))
        if task == "seq2seq":
            return hf.Case(model, {**inputs, "labels": _ids(B, T, seed=3)}, hf._seq2seq_loss, T)
        return hf.Case(model, {**inputs, "labels": hf._labels(B)}, hf._cls_loss, T)
    if condition == "mask":
        return None
    if condition == "T=B":
        if built.seq is None or built.seq < 2 or built.seq > 80:
            return None
        B = built.seq
    g = torch.Generator().manual_seed(1)
    inputs = {k: torch.randn((B, *v.shape[1:]), generator=g, dtype=v.dtype) for k, v in built.template.items()}
    return hf.Case(model, {**inputs, "labels": hf._labels(B)}, hf._cls_loss, built.seq or 0)


def independence(case: hf.Case) -> tuple[bool, float]:
    """(whether each example's loss in the batch equals its loss alone, to :data:`INDEPENDENT_GAP`; the largest
    relative gap), float64."""
    with torch.no_grad():
        together = case.loss(case.model, case.inputs)
        B = together.shape[0]
        alone = torch.cat([case.loss(case.model, hf._slice(case.inputs, i)) for i in range(B)])
    gap = float(((together - alone).abs() / alone.abs().clamp_min(1e-300)).max())
    return gap <= INDEPENDENT_GAP, gap


# the largest relative gap between an example's loss in the batch and alone that counts as independent: a
# float64 model agrees to 1e-16, one that computes in float32 inside (routers, norms) to about 1e-9; examples
# that interact (batch statistics, expert capacity) differ far more
INDEPENDENT_GAP = 1e-6


def _independent(result: dict) -> bool | None:
    """A condition's independence verdict, from its recorded gap (so that the threshold applies to old records)."""
    gap = result.get("loss_gap")
    return result.get("independent") if gap is None else gap <= INDEPENDENT_GAP


def survey_one(
    model_type: str, task: str, class_name: str, modes=hf.MODES, conditions=tuple(CONDITIONS), progress=None
) -> dict:
    """The record of one (type, task): not built (with the reason), or per condition the independence test
    and each mode's outcome (a JSON-ready dict).  ``progress(phase, record)``, if given, is told each phase
    first ("build", "reference <condition>", "<mode> <condition>") with the record so far: where a process
    that hangs was, and what it had found."""
    import warnings

    progress = progress or (lambda phase, record: None)

    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    record = {"model_type": model_type, "task": task, "class": class_name, "conditions": {}}
    try:
        progress("build", record)
        built = build_model(model_type, task, class_name)
    except NotBuilt as exc:
        return {**record, "not_built": str(exc), "seconds": round(time.perf_counter() - start, 2)}
    record["parameters"] = built.parameters
    for condition in conditions:
        case = build_case(built, task, condition)
        if case is None:
            record["conditions"][condition] = None
            continue
        try:
            progress(f"reference {condition}", record)
            params, grads = hf.reference(case)
            if not torch.isfinite(grads).all():
                raise ValueError("non-finite per-example gradients in float64 (the model, not the engine)")
            independent, gap = independence(case)
        except Exception as exc:  # the model or the harness: the reference itself fails
            if condition == conditions[0]:
                return {**record, "not_built": f"reference: {hf._first_line(exc, 200)}"}
            record["conditions"][condition] = {"error": f"reference: {hf._first_line(exc, 200)}"}
            continue
        cells, floors = {}, {}
        record["conditions"][condition] = {"independent": independent, "loss_gap": _num(gap), "cells": cells}
        for mode in modes:
            progress(f"{mode} {condition}", record)
            outcome = hf.check_case(case, params, grads, mode, floors=floors)
            cells[mode] = {
                "status": outcome.status,
                "detail": outcome.detail,
                "norm_err": _num(outcome.norm_err),
                "sum_err": _num(outcome.sum_err),
                "seconds": round(outcome.seconds, 3),
            }
    record["seconds"] = round(time.perf_counter() - start, 2)
    return record


def _num(x: float):
    return None if x != x else float(f"{x:.3g}")


# --- the table ---------------------------------------------------------------------------------------
MODE_TITLES = {
    "bk": "bk",
    "ghost": "ghost",
    "hooks": "hooks",
    "opacus-hooks": "Opacus hooks",
    "opacus-ghost": "Opacus ghost",
}
# the outcome of one mode on one architecture (worst condition first), as counted in the table
OUTCOMES = ("exact", "refused, examples interact", "refused, examples independent", "crash", "WRONG", "error")
HARNESS = "not built"


def outcome(record: dict, mode: str) -> tuple[str, str, str]:
    """(outcome of :data:`OUTCOMES` or "not built", the condition it was seen at, the detail) of one mode
    over the record's conditions: WRONG before crash before refused before error before exact."""
    if "not_built" in record:
        return HARNESS, "", record["not_built"]
    seen = []
    for condition, result in record["conditions"].items():
        if not result:
            continue
        if "error" in result:
            seen.append(("error", condition, result["error"]))
            continue
        cell = result["cells"].get(mode)
        if cell is None:
            continue
        status = cell["status"]
        if status == "refused":
            interact = _independent(result) is False
            status = "refused, examples interact" if interact else "refused, examples independent"
        seen.append((status, condition, cell["detail"]))
    rank = {"WRONG": 0, "crash": 1, "refused, examples independent": 2, "refused, examples interact": 3, "error": 4}
    bad = sorted((s for s in seen if s[0] != "exact"), key=lambda s: rank[s[0]])
    if bad:
        return bad[0]
    return ("exact", "", "") if seen else ("error", "", "no condition ran")


def reason(detail: str) -> str:
    """A refusal's or crash's message with what varies between architectures blanked (names, numbers)."""
    import re

    text = re.sub(r"\b[A-Z]\w*\.forward\(\)", "….forward()", detail)  # the class of each model
    text = re.sub(r"'[^']*'", "'…'", text)
    text = re.sub(r'"[^"]*"', '"…"', text)
    text = re.sub(r"\b\d+(\.\d+)?(e-?\d+)?\b", "N", text)
    text = re.sub(r"\[[^\]]*\]", "[…]", text)
    return text[:160]


def _cell(status: str, condition: str) -> str:
    short = {
        "refused, examples interact": "refused (interact)",
        "refused, examples independent": "refused (independent)",
    }
    label = short.get(status, status)
    return f"{label} [{condition}]" if condition and status != "exact" else label


def summary(records: list[dict]) -> dict:
    """Counts per mode and outcome, and the reasons grouped (reason → count and a few architectures)."""
    counts = {m: dict.fromkeys((*OUTCOMES, HARNESS), 0) for m in MODE_TITLES}
    reasons: dict[str, dict] = {}
    for r in records:
        name = f"{r['model_type']} ({r['task']})"
        for mode in MODE_TITLES:
            status, _condition, detail = outcome(r, mode)
            counts[mode][status] += 1
            if status == "exact" or (status == HARNESS and mode != "bk"):
                continue
            group = reasons.setdefault(f"{status}: {reason(detail)}", {"count": 0, "modes": [], "architectures": []})
            group["count"] += 1
            if mode not in group["modes"]:
                group["modes"].append(mode)
            if name not in group["architectures"]:
                group["architectures"].append(name)
    ordered = dict(sorted(reasons.items(), key=lambda kv: (-kv[1]["count"], kv[0])))
    return {"architectures": len(records), "counts": counts, "reasons": ordered}


def _esc(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def render(results: dict) -> str:
    """docs/architectures.md from the survey's JSON (``bench/results/architectures.json``); the page is this
    function's output, never edited by hand (``tests/test_hf_architectures.py`` checks it)."""
    records = results["records"]
    s = summary(records)
    modes = list(MODE_TITLES)
    lines = [
        "# Architectures: which a user can train, in which mode",
        "",
        "<!-- generated by `python bench/survey_architectures.py --enumerate` from "
        "bench/results/architectures.json: do not edit by hand -->",
        "",
        f"Every architecture of transformers {results['versions']['transformers']}'s auto-model mappings (causal LM, "
        "sequence classification, seq2seq LM, image and audio classification), each built tiny from its default "
        "config (no download), in float64. For each mode, one noiseless step of the engine (idpsgd's `bk`, "
        "`ghost`, `hooks`; Opacus's own `hooks` and `ghost` for comparison) is compared with one backward pass per "
        "example: the per-example gradient norms and the clipped sum, at T ≠ B, at T = B and on a right-padded "
        "batch with its attention mask (text models). A cell is the worst outcome over the conditions, the "
        "condition named in brackets:",
        "",
        "* **exact**: norms and clipped sum equal the reference (1e-8 relative, or 10 × the model's own float32 "
        "rounding where it computes in float32 inside);",
        "* **refused (interact)**: the engine refused with its own error, and the examples really interact (an "
        "example's loss in the batch differs from its loss alone by more than 1e-6 relative, in float64);",
        "* **refused (independent)**: refused although every example's loss is the same in the batch as alone: a "
        "refusal stricter than needed;",
        "* **crash**: an error from PyTorch, transformers or Opacus escaped the engine (or the process hung or died);",
        "* **WRONG**: the engine returned norms or a clipped sum that differ from the reference: a silent "
        "misattribution;",
        "* **not built**: the harness could not build the architecture tiny (the reason is listed below); not an "
        "outcome of the engine.",
        "",
        "Regenerate with `python bench/survey_architectures.py --enumerate --fresh` (one architecture at a time, "
        f"each in its own process; the architectures' own times add up to {results.get('wall_s', 0) / 60:.0f} "
        "minutes on one core).",
        f"Versions: {', '.join(f'{k} {v}' for k, v in results['versions'].items())}.",
        "",
        "## Counts",
        "",
        f"{s['architectures']} architectures (model type × task) surveyed"
        + (f", of the {results['enumerated']} enumerated." if s["architectures"] != results["enumerated"] else "."),
        "",
        "| outcome | " + " | ".join(MODE_TITLES[m] for m in modes) + " |",
        "|---" * (len(modes) + 1) + "|",
    ]
    for status in (*OUTCOMES, HARNESS):
        lines.append(f"| {status} | " + " | ".join(str(s["counts"][m][status]) for m in modes) + " |")
    lines += [
        "",
        "## Per architecture",
        "",
        "| architecture | task | class | " + " | ".join(MODE_TITLES[m] for m in modes) + " |",
        "|---" * (len(modes) + 3) + "|",
    ]
    built = [r for r in records if "not_built" not in r]
    for r in built:
        cells = [_cell(*outcome(r, m)[:2]) for m in modes]
        lines.append(f"| {r['model_type']} | {r['task']} | {r['class']} | " + " | ".join(cells) + " |")
    behind = [r for r in built if outcome(r, "opacus-hooks")[0] == "exact" and outcome(r, "bk")[0] != "exact"]
    lines += ["", "## Where Opacus's hooks is exact and bk is not", ""]
    lines += [f"{len(behind)} architectures" + (":" if behind else "."), ""]
    for r in behind:
        status, condition, detail = outcome(r, "bk")
        lines.append(f"* {r['model_type']} ({r['task']}): {_cell(status, condition)}: {_esc(detail[:200])}")
    lines += [
        "",
        "## Reasons",
        "",
        "Refusals, crashes and wrong results, grouped by message (names and numbers blanked).",
        "",
    ]
    lines += ["| outcome: reason | cells | modes | architectures |", "|---|---|---|---|"]
    for text, group in s["reasons"].items():
        if text.startswith(HARNESS):
            continue
        archs = ", ".join(group["architectures"][:6]) + (
            f" and {len(group['architectures']) - 6} more" if len(group["architectures"]) > 6 else ""
        )
        lines.append(f"| {_esc(text)} | {group['count']} | {', '.join(group['modes'])} | {_esc(archs)} |")
    lines += ["", "## Not built", "", "| architecture | task | why |", "|---|---|---|"]
    for r in records:
        if "not_built" in r:
            lines.append(f"| {r['model_type']} | {r['task']} | {_esc(r['not_built'])} |")
    return "\n".join(lines) + "\n"


# --- one architecture in its own process -------------------------------------------------------------
def warm_up() -> None:
    """Import and exercise what every architecture needs (idpsgd's engine, Opacus, torch.func, transformers'
    modelling code) once, in the process that forks the others: a forked child then starts warm (an
    architecture takes seconds, not the dozen seconds of its imports)."""
    import opacus  # noqa: F401
    import torch

    import idpsgd  # noqa: F401
    import sensitivity_harness  # noqa: F401

    # One thread before any op: GNU OpenMP keeps no state a fork can inherit, so a child forked after the parent
    # ran a parallel op waits forever at its first parallel op (seen: every architecture a timeout).  The
    # architectures are tiny; ``--jobs`` is the parallelism.
    torch.set_num_threads(1)
    survey_one("llama", "seq-cls", "LlamaForSequenceClassification", conditions=("T!=B",))


def failed(model_type: str, task: str, class_name: str, modes, why: str, seconds: float, progress=None) -> dict:
    """The record of a process that hung or died, from its last ``progress`` ({"phase", "record"} of
    :func:`survey_one`): in a mode, what it had found and a crash of that mode at that condition (the modes
    after it not run); in the harness (building, the reference), not built; unknown, a crash in every mode."""
    phase = (progress or {}).get("phase", "")
    record = (progress or {}).get("record") or {"model_type": model_type, "task": task, "class": class_name}
    record = {**record, "conditions": dict(record.get("conditions", {})), "seconds": seconds}
    mode, _, condition = phase.partition(" ")
    if phase == "build" or mode == "reference":
        return {**record, "not_built": f"{why} (in the harness: {phase})"}
    if mode not in modes:  # no progress known: every mode at the first condition
        first = next(iter(CONDITIONS))
        cell = {"status": "crash", "detail": why, "norm_err": None, "sum_err": None, "seconds": seconds}
        record["conditions"] = {first: {"independent": None, "loss_gap": None, "cells": dict.fromkeys(modes, cell)}}
        return record
    result = record["conditions"].get(condition) or {"independent": None, "loss_gap": None, "cells": {}}
    cells = dict(result["cells"])
    cells[mode] = {"status": "crash", "detail": why, "norm_err": None, "sum_err": None, "seconds": seconds}
    for m in modes:
        cells.setdefault(m, {"status": "error", "detail": f"not run: {mode} hung or died before", "norm_err": None})
    record["conditions"][condition] = {**result, "cells": cells}
    return record


def _child(target, args, path):
    from idpsgd.io import write_json

    def progress(phase, record):
        write_json(f"{path}.progress", {"phase": phase, "record": record})

    write_json(path, target(*args, progress=progress) if target is survey_one else target(*args))


def start(path, target=None, args=()):
    """A forked process that writes ``target(*args)`` (default :func:`survey_one`) as JSON to ``path``."""
    import multiprocessing

    proc = multiprocessing.get_context("fork").Process(
        target=_child, args=(target or survey_one, args, path), daemon=True
    )
    proc.start()
    return proc


def finish(proc, path, started: float, timeout: float, arch: tuple, modes) -> dict | None:
    """The record of a process of :func:`start` once it has ended (None while it runs within ``timeout``):
    a hang past the timeout is killed and becomes a "crash: timeout" record, a death by a signal or an
    exit without a record a "crash: signal" one (the survey goes on)."""
    import json
    import os
    import signal
    from pathlib import Path

    from idpsgd.io import write_json

    elapsed = round(time.perf_counter() - started, 1)
    marker = f"{path}.progress"
    progress = None
    if os.path.exists(marker):
        with contextlib.suppress(ValueError):  # (written atomically: complete or absent)
            progress = json.loads(Path(marker).read_text())
    if proc.is_alive():
        if elapsed < timeout:
            return None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        write_json(path, failed(*arch, modes, f"timeout: no result after {timeout:.0f} s", elapsed, progress))
    else:
        proc.join()
        if proc.exitcode != 0 or not os.path.exists(path):
            code = proc.exitcode
            why = f"signal: the process died ({signal.Signals(-code).name})" if code and code < 0 else f"exit {code}"
            write_json(path, failed(*arch, modes, why, elapsed, progress))
    if os.path.exists(marker):
        os.unlink(marker)
    with open(path) as fh:
        return json.load(fh)


def run_isolated(arch: tuple, modes, path, timeout: float = 300.0, target=None) -> dict:
    """One architecture (``(type, task, class)``) surveyed in a forked process (:func:`start`, :func:`finish`)."""
    started = time.perf_counter()
    proc = start(path, target, (*arch, modes) if target is None else arch)
    while (record := finish(proc, path, started, timeout, arch, modes)) is None:
        time.sleep(0.05)
    return record
