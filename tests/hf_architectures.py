"""Tiny Hugging Face models of many architectures, built from configs (no download), and a harness that
checks the engine's book-keeping against brute force (issue 36, "attribution by provenance").

Every factory ``make(B, T)`` returns a :class:`Case`: a model (dropout 0, 2 layers, hidden 32, vocab 97,
with a task head: LM head for decoders and encoder-decoders, sequence classification for encoders,
image or audio classification for vision and Whisper), the inputs of a batch of ``B`` examples and a
per-example loss ``loss(model, inputs) -> (B,)``.  Text models take sequences of ``T`` tokens; Whisper's
encoder ``2T`` audio frames (``T`` positions after its strided convolution); the vision models take
8 × 8 images whose first-stage token grid is fixed (:attr:`Case.seq`: ViT 4 patches + the class token =
5, Swin 4 × 4 = 16 patches, ConvNeXt a 4 × 4 map), so their "T = B" case takes ``B = seq``.

The check (:func:`check`): per-example gradients of every trainable parameter by one backward pass per
example (the reference, in float64 unless the model is float32), hence the exact norms ‖g_i‖ and the
clipped sum Σ_i min(1, c_i/‖g_i‖) g_i for per-example clip norms c_i; against the engine's book-keeper
(:class:`idpsgd.engine.per_example.bk.keeper.BookKeeper`, the machinery of ``grad_sample_mode="bk"`` and of the
norm passes, attached with the engine's batch-independence check as a norm pass does: one backward
pass of the summed per-example losses, then ``norms()`` and ``clipped_sum(factors)``).  The outcome:

* ``exact``: norms and clipped sums within the tolerance (1e-8 relative in float64);
* ``refused: <message>``: the engine refused with its own error (raised by idpsgd's code: it did not train);
* ``crash: <message>``: an error raised inside PyTorch, Opacus or transformers while the engine ran (it did
  not train either, but the message is not the engine's: no layer or reason named);
* ``WRONG (...)``: the engine returned a result that differs — a silent misattribution;
* ``error: <message>``: the model or the reference failed (the harness, not the engine).

Run ``python tests/hf_architectures.py`` (or ``bench/survey_architectures.py``) for the table.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

V = 97  # vocabulary
H = 32  # hidden size
LABELS = 3


@dataclasses.dataclass
class Case:
    model: nn.Module
    inputs: dict  # keyword arguments of the model's forward (tensors with B rows)
    loss: Callable  # loss(model, inputs) -> one loss per example
    seq: int  # the sequence length (tokens, positions or first-stage grid) the model sees


def _tf():
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def _ids(B, T, seed=1, low=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, V, (B, T), generator=g)


def _labels(B, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, LABELS, (B,), generator=g)


def _lm_loss(model, inputs):
    """The mean next-token loss of each example (over its unpadded tokens, with an attention mask)."""
    ids, mask = inputs["input_ids"], inputs.get("attention_mask")
    logits = model(input_ids=ids, attention_mask=mask).logits
    tokens = nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float() if logits.dtype == torch.bfloat16 else logits[:, :-1].flatten(0, 1),
        ids[:, 1:].flatten(),
        reduction="none",
    ).view(ids.shape[0], -1)
    if mask is None:
        return tokens.mean(1)
    m = mask[:, 1:].to(tokens.dtype)
    return (tokens * m).sum(1) / m.sum(1)


def _seq2seq_loss(model, inputs):
    """The mean token loss of each example's target sequence (teacher forcing)."""
    out = model(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"), labels=inputs["labels"])
    logits = out.logits.float() if out.logits.dtype == torch.bfloat16 else out.logits
    tokens = nn.functional.cross_entropy(logits.flatten(0, 1), inputs["labels"].flatten(), reduction="none")
    return tokens.view(inputs["labels"].shape[0], -1).mean(1)


def _cls_loss(model, inputs):
    kwargs = {k: v for k, v in inputs.items() if k != "labels"}
    logits = model(**kwargs).logits
    return nn.functional.cross_entropy(
        logits.float() if logits.dtype == torch.bfloat16 else logits, inputs["labels"], reduction="none"
    )


# --- decoders -----------------------------------------------------------------------------------
def _decoder(model, B, T):
    return Case(model, {"input_ids": _ids(B, T)}, _lm_loss, T)


def gpt2(B, T, **config):
    t = _tf()
    cfg = t.GPT2Config(
        **{
            "n_layer": 2,
            "n_embd": H,
            "n_head": 2,
            "vocab_size": V,
            "n_positions": 64,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "bos_token_id": 0,
            "eos_token_id": 0,
            **config,
        }
    )
    return _decoder(t.GPT2LMHeadModel(cfg), B, T)


def gpt_neox(B, T):
    t = _tf()
    cfg = t.GPTNeoXConfig(
        num_hidden_layers=2,
        hidden_size=H,
        num_attention_heads=2,
        intermediate_size=37,
        vocab_size=V,
        max_position_embeddings=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return _decoder(t.GPTNeoXForCausalLM(cfg), B, T)


def opt(B, T):
    t = _tf()
    cfg = t.OPTConfig(
        num_hidden_layers=2,
        hidden_size=H,
        num_attention_heads=2,
        ffn_dim=37,
        vocab_size=V,
        max_position_embeddings=64,
        word_embed_proj_dim=H,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        layerdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
    )
    return _decoder(t.OPTForCausalLM(cfg), B, T)


def bloom(B, T):
    t = _tf()
    cfg = t.BloomConfig(
        n_layer=2,
        hidden_size=H,
        n_head=2,
        vocab_size=V,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
    )
    return _decoder(t.BloomForCausalLM(cfg), B, T)


def falcon(B, T):
    t = _tf()
    cfg = t.FalconConfig(
        num_hidden_layers=2,
        hidden_size=H,
        num_attention_heads=2,
        vocab_size=V,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
        max_position_embeddings=64,
    )
    return _decoder(t.FalconForCausalLM(cfg), B, T)


def _llama_like(cls_cfg, cls_model, B, T, **extra):
    t = _tf()
    cfg = getattr(t, cls_cfg)(
        **{
            "num_hidden_layers": 2,
            "hidden_size": H,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "vocab_size": V,
            "max_position_embeddings": 64,
            "bos_token_id": 0,
            "eos_token_id": 0,
            "pad_token_id": 1,
            "intermediate_size": 37,
            **extra,
        }
    )
    return _decoder(getattr(t, cls_model)(cfg), B, T)


def llama(B, T, **config):
    return _llama_like("LlamaConfig", "LlamaForCausalLM", B, T, **config)


def mistral(B, T):
    return _llama_like("MistralConfig", "MistralForCausalLM", B, T, sliding_window=4)


def qwen2(B, T):
    return _llama_like("Qwen2Config", "Qwen2ForCausalLM", B, T)


def gemma(B, T):
    return _llama_like("GemmaConfig", "GemmaForCausalLM", B, T, head_dim=16)


def phi(B, T):
    t = _tf()
    cfg = t.PhiConfig(
        num_hidden_layers=2,
        hidden_size=H,
        num_attention_heads=2,
        intermediate_size=37,
        vocab_size=V,
        max_position_embeddings=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attention_dropout=0.0,
        partial_rotary_factor=0.5,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
    )
    return _decoder(t.PhiForCausalLM(cfg), B, T)


# held out (not named in the issue): mixture-of-experts decoders (row routing) and other decoders
def mixtral(B, T):
    return _llama_like(
        "MixtralConfig",
        "MixtralForCausalLM",
        B,
        T,
        intermediate_size=36,  # grouped_mm (float32 default of the experts) needs rows of a multiple of 16 bytes
        num_local_experts=4,
        num_experts_per_tok=2,
        router_jitter_noise=0.0,
        experts_implementation="eager",  # grouped_mm has no float64 (a saved folder is loaded with the default)
    )


def qwen2_moe(B, T):
    return _llama_like(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        B,
        T,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=12,
        shared_expert_intermediate_size=16,
        decoder_sparse_step=1,
        experts_implementation="eager",
    )


def gptj(B, T):
    t = _tf()
    cfg = t.GPTJConfig(
        n_layer=2,
        n_embd=H,
        n_head=2,
        rotary_dim=8,
        vocab_size=V,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return _decoder(t.GPTJForCausalLM(cfg), B, T)


def mpt(B, T):
    t = _tf()
    cfg = t.MptConfig(
        n_layers=2,
        d_model=H,
        n_heads=2,
        expansion_ratio=2,
        vocab_size=V,
        max_seq_len=64,
        resid_pdrop=0.0,
        emb_pdrop=0.0,
    )
    return _decoder(t.MptForCausalLM(cfg), B, T)


# --- encoder-decoders ---------------------------------------------------------------------------
def _seq2seq(model, B, T):
    return Case(model, {"input_ids": _ids(B, T), "labels": _ids(B, T, seed=3)}, _seq2seq_loss, T)


def t5(B, T):
    t = _tf()
    cfg = t.T5Config(
        num_layers=2,
        num_decoder_layers=2,
        d_model=H,
        d_kv=16,
        d_ff=37,
        num_heads=2,
        vocab_size=V,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return _seq2seq(t.T5ForConditionalGeneration(cfg), B, T)


def bart(B, T):
    t = _tf()
    cfg = t.BartConfig(
        encoder_layers=2,
        decoder_layers=2,
        d_model=H,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=37,
        decoder_ffn_dim=37,
        vocab_size=V,
        max_position_embeddings=64,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
    )
    return _seq2seq(t.BartForConditionalGeneration(cfg), B, T)


# --- encoders -----------------------------------------------------------------------------------
def _encoder(model, B, T):
    return Case(model, {"input_ids": _ids(B, T), "labels": _labels(B)}, _cls_loss, T)


_BERTLIKE = dict(
    num_hidden_layers=2,
    hidden_size=H,
    num_attention_heads=2,
    intermediate_size=37,
    vocab_size=V,
    max_position_embeddings=64,
    num_labels=LABELS,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


def bert(B, T, **config):
    t = _tf()
    return _encoder(t.BertForSequenceClassification(t.BertConfig(**{**_BERTLIKE, **config})), B, T)


def roberta(B, T):
    t = _tf()
    return _encoder(t.RobertaForSequenceClassification(t.RobertaConfig(**_BERTLIKE, pad_token_id=1)), B, T)


def distilbert(B, T):
    t = _tf()
    cfg = t.DistilBertConfig(
        n_layers=2,
        dim=H,
        n_heads=2,
        hidden_dim=37,
        vocab_size=V,
        max_position_embeddings=64,
        num_labels=LABELS,
        dropout=0.0,
        attention_dropout=0.0,
        seq_classif_dropout=0.0,
    )
    return _encoder(t.DistilBertForSequenceClassification(cfg), B, T)


def albert(B, T):
    t = _tf()
    cfg = t.AlbertConfig(
        num_hidden_layers=2,
        embedding_size=16,
        hidden_size=H,
        num_attention_heads=2,
        intermediate_size=37,
        vocab_size=V,
        max_position_embeddings=64,
        num_labels=LABELS,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
    )
    return _encoder(t.AlbertForSequenceClassification(cfg), B, T)


def electra(B, T):
    t = _tf()
    cfg = t.ElectraConfig(**_BERTLIKE, embedding_size=16)
    return _encoder(t.ElectraForSequenceClassification(cfg), B, T)


def deberta_v2(B, T):
    t = _tf()
    cfg = t.DebertaV2Config(
        **_BERTLIKE,
        relative_attention=True,
        position_buckets=8,
        max_relative_positions=16,
        pos_att_type=["p2c", "c2p"],
        pooler_dropout=0.0,
        pooler_hidden_size=H,
    )
    return _encoder(t.DebertaV2ForSequenceClassification(cfg), B, T)


def mobilebert(B, T):
    t = _tf()
    cfg = t.MobileBertConfig(
        num_hidden_layers=2,
        hidden_size=H,
        num_attention_heads=2,
        intermediate_size=37,
        embedding_size=16,
        intra_bottleneck_size=16,
        true_hidden_size=16,
        vocab_size=V,
        max_position_embeddings=64,
        num_labels=LABELS,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_feedforward_networks=2,
    )
    return _encoder(t.MobileBertForSequenceClassification(cfg), B, T)


def xlm_roberta(B, T):  # held out
    t = _tf()
    return _encoder(t.XLMRobertaForSequenceClassification(t.XLMRobertaConfig(**_BERTLIKE, pad_token_id=1)), B, T)


def megatron_bert(B, T):  # held out
    t = _tf()
    return _encoder(t.MegatronBertForSequenceClassification(t.MegatronBertConfig(**_BERTLIKE)), B, T)


class _CLIPTextClassifier(nn.Module):
    """CLIP's text tower with a classification head on its pooled (end-of-text) output."""

    def __init__(self, text):
        super().__init__()
        self.text = text
        self.head = nn.Linear(text.config.hidden_size, LABELS)
        self.config = text.config

    def forward(self, input_ids, attention_mask=None):
        from transformers.modeling_outputs import SequenceClassifierOutput

        pooled = self.text(input_ids=input_ids, attention_mask=attention_mask).pooler_output
        return SequenceClassifierOutput(logits=self.head(pooled))


def clip_text(B, T):
    t = _tf()
    cfg = t.CLIPTextConfig(
        num_hidden_layers=2,
        hidden_size=H,
        num_attention_heads=2,
        intermediate_size=37,
        vocab_size=V,
        max_position_embeddings=64,
        dropout=0.0,
        attention_dropout=0.0,
        eos_token_id=2,
        bos_token_id=0,
        pad_token_id=1,
    )
    return _encoder(_CLIPTextClassifier(t.CLIPTextModel(cfg)), B, T)


def whisper_encoder(B, T):
    t = _tf()
    cfg = t.WhisperConfig(
        encoder_layers=2,
        decoder_layers=2,
        d_model=H,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=37,
        decoder_ffn_dim=37,
        vocab_size=V,
        num_mel_bins=8,
        max_source_positions=T,
        max_target_positions=16,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        encoder_layerdrop=0.0,
        num_labels=LABELS,
        classifier_proj_size=16,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=0,
    )
    g = torch.Generator().manual_seed(1)
    feats = torch.randn((B, 8, 2 * T), generator=g)
    return Case(t.WhisperForAudioClassification(cfg), {"input_features": feats, "labels": _labels(B)}, _cls_loss, T)


# --- vision -------------------------------------------------------------------------------------
def _image(model, B, seq):
    g = torch.Generator().manual_seed(1)
    return Case(model, {"pixel_values": torch.randn((B, 3, 8, 8), generator=g), "labels": _labels(B)}, _cls_loss, seq)


def vit(B, T, **config):
    t = _tf()
    cfg = t.ViTConfig(
        **{
            "num_hidden_layers": 2,
            "hidden_size": H,
            "num_attention_heads": 2,
            "intermediate_size": 37,
            "image_size": 8,
            "patch_size": 4,
            "num_labels": LABELS,
            "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0,
            **config,
        }
    )
    return _image(t.ViTForImageClassification(cfg), B, 5)


def swin(B, T):
    t = _tf()
    cfg = t.SwinConfig(
        image_size=8,
        patch_size=2,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[2, 2],
        window_size=2,
        mlp_ratio=2.0,
        num_labels=LABELS,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0,
    )
    return _image(t.SwinForImageClassification(cfg), B, 16)


def convnext(B, T):
    t = _tf()
    cfg = t.ConvNextConfig(
        num_channels=3,
        patch_size=2,
        image_size=8,
        hidden_sizes=[16, H],
        depths=[1, 1],
        num_stages=2,
        num_labels=LABELS,
        drop_path_rate=0.0,
    )
    return _image(t.ConvNextForImageClassification(cfg), B, 4)


ARCHITECTURES: dict[str, Callable[[int, int], Case]] = {
    "gpt2": gpt2,
    "gpt_neox": gpt_neox,
    "opt": opt,
    "bloom": bloom,
    "falcon": falcon,
    "llama": llama,
    "mistral": mistral,
    "qwen2": qwen2,
    "gemma": gemma,
    "phi": phi,
    "t5": t5,
    "bart": bart,
    "bert": bert,
    "roberta": roberta,
    "distilbert": distilbert,
    "albert": albert,
    "electra": electra,
    "deberta_v2": deberta_v2,
    "mobilebert": mobilebert,
    "vit": vit,
    "swin": swin,
    "convnext": convnext,
    "clip_text": clip_text,
    "whisper_encoder": whisper_encoder,
}
HELD_OUT: dict[str, Callable[[int, int], Case]] = {
    "mixtral": mixtral,
    "qwen2_moe": qwen2_moe,
    "gptj": gptj,
    "mpt": mpt,
    "xlm_roberta": xlm_roberta,
    "megatron_bert": megatron_bert,
}
ALL = {**ARCHITECTURES, **HELD_OUT}
DECODERS = (
    "gpt2",
    "gpt_neox",
    "opt",
    "bloom",
    "falcon",
    "llama",
    "mistral",
    "qwen2",
    "gemma",
    "phi",
    "mixtral",
    "qwen2_moe",
    "gptj",
    "mpt",
)
VISION = ("vit", "swin", "convnext")

# (B, T) of the two shape cases: T ≠ B, and T = B (where a guess of the batch dimension by shape can take a
# (T, ...) tensor for the batch); the vision models' T is fixed (Case.seq), so their T = B case takes B = seq
SHAPES = {"T!=B": (3, 7), "T=B": (5, 5)}
TOL_FLOAT64 = 1e-8  # relative, norms and clipped sums
TOL_BF16 = 5e-2  # relative to the float32 reference, norms and clipped sums: bf16 autocast rounding (8 bits)


def shape(name: str, case_name: str) -> tuple[int, int]:
    B, T = SHAPES[case_name]
    if case_name == "T=B" and name in VISION:
        seq = ALL[name](1, T).seq
        return seq, seq
    return B, T


# --- LoRA ---------------------------------------------------------------------------------------
LORA_TARGETS = {  # the attention projections (query and value) of each model; default q_proj, v_proj
    "gpt2": ["c_attn"],
    "gpt_neox": ["query_key_value"],
    "bloom": ["query_key_value"],
    "falcon": ["query_key_value"],
    "mpt": ["Wqkv"],
    "t5": ["q", "v"],
    "distilbert": ["q_lin", "v_lin"],
    "deberta_v2": ["query_proj", "value_proj"],
    **{
        name: ["query", "value"]
        for name in (
            "bert",
            "roberta",
            "albert",
            "electra",
            "mobilebert",
            "xlm_roberta",
            "megatron_bert",
        )
    },
}
LORA = tuple(name for name in ALL if name != "convnext")  # every model with attention (the decoders included)


def with_lora(case: Case, name: str) -> Case:
    """The case's model with LoRA adapters (rank 4) on its attention projections (peft): only the adapters train."""
    import peft

    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=LORA_TARGETS.get(name, ["q_proj", "v_proj"]),
        fan_in_fan_out=name == "gpt2",
    )
    if isinstance(case.model, _CLIPTextClassifier):  # the text tower gets the adapters, the head trains whole
        case.model.text = peft.get_peft_model(case.model.text, config)
        model = case.model
    else:
        model = peft.get_peft_model(case.model, config)
    g = torch.Generator().manual_seed(4)
    for n, p in model.named_parameters():  # non-zero B matrices: the adapters' gradients are all non-trivial
        if "lora_B" in n:
            with torch.no_grad():
                p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return dataclasses.replace(case, model=model)


# --- the check ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Outcome:
    status: str  # "exact", "refused", "crash", "WRONG", "error" (or "n/a")
    detail: str = ""
    norm_err: float = float("nan")
    sum_err: float = float("nan")
    seconds: float = 0.0

    def __str__(self):
        if self.status in ("exact", "n/a"):
            return self.status
        if self.status == "WRONG":
            return f"WRONG ({self.detail})"
        return f"{self.status}: {self.detail}"


def _first_line(exc: BaseException, limit: int = 320) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text if len(text) <= limit else text[: limit - 1] + "…"


def padding_mask(B: int, T: int) -> torch.Tensor:
    """An attention mask of a right-padded batch: example i has T - (i mod 3) tokens (at least 2)."""
    lengths = torch.tensor([max(2, T - i % 3) for i in range(B)])
    return (torch.arange(T)[None, :] < lengths[:, None]).long()


def build(name: str, B: int, T: int, *, dtype=torch.float64, lora: bool = False, mask: bool = False) -> Case:
    _tf()
    torch.manual_seed(0)
    case = ALL[name](B, T)
    case.model.to(dtype).train()
    case.inputs = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in case.inputs.items()}
    if mask:
        case.inputs["attention_mask"] = padding_mask(B, T)
    if lora:
        case = with_lora(case, name)
    return case


def tiny_model(name: str, **config) -> nn.Module:
    """The model alone of the factory ``name`` (of :data:`ALL`), its config's fields overridden by ``config``
    (``gpt2``, ``llama``, ``bert`` and ``vit`` take overrides): built in float32 from the global seed, as
    the factory builds it; the caller seeds, converts and sets train mode."""
    return ALL[name](1, 1, **config).model


def _slice(inputs: dict, i: int) -> dict:
    return {k: v[i : i + 1] for k, v in inputs.items()}


def reference(case: Case) -> tuple[list[tuple[str, nn.Parameter]], torch.Tensor]:
    """(trainable parameters of a copy of the model, per-example gradients (B, P)): one backward per example."""
    model = copy.deepcopy(case.model)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    B = next(iter(case.inputs.values())).shape[0]
    rows = []
    for i in range(B):
        model.zero_grad(set_to_none=True)
        loss = case.loss(model, _slice(case.inputs, i))
        assert loss.shape == (1,), loss.shape
        loss.sum().backward()
        rows.append(torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for _, p in params]))
    return params, torch.stack(rows)


def clip_norms(B: int, norms: torch.Tensor) -> torch.Tensor:
    """Per-example clip norms c_i that clip some examples and not others (between 0.3 and 1.5 × the median norm)."""
    return norms.median() * torch.linspace(0.3, 1.5, B, dtype=norms.dtype)


def engine_result(case: Case, factors: Callable[[torch.Tensor], torch.Tensor]):
    """(norms, {name: clipped sum}) of the engine's book-keeper: attached as a norm pass attaches it (the
    batch-independence check first), one backward pass of the summed per-example losses."""
    from idpsgd.engine.guards.batch_independence import BatchIndependence
    from idpsgd.engine.per_example.bk.keeper import BookKeeper

    model = case.model
    BatchIndependence.attach(model)
    keeper = BookKeeper.attach(model)
    keeper.active, keeper.loss_reduction = True, "sum"
    keeper.clear()
    try:
        case.loss(model, case.inputs).sum().backward()
        norms = keeper.norms()
        sums = keeper.clipped_sum(factors(norms))
        by_id = {id(p): n for n, p in model.named_parameters()}
        return norms.detach(), {by_id[id(p)]: s.detach() for p, s in sums.items()}
    finally:
        keeper.clear()
        keeper.active = False


def _raised_by_engine(exc: BaseException, package: str = "idpsgd") -> bool:
    """Whether ``package`` (idpsgd, or Opacus for its own modes) refused on purpose: an exception class of its
    own, or a ``raise`` statement in its code as the innermost frame (an error of a torch op called from
    its code is not a refusal, nor a programming error such as a call with missing arguments)."""
    import traceback

    if (type(exc).__module__ or "").split(".")[0] == package:
        return True
    if isinstance(exc, (TypeError, AttributeError, KeyError, IndexError)):
        return False  # a programming error (a call with missing arguments fails in the caller's frame)
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames or package not in frames[-1].filename.replace("\\", "/").split("/"):
        return False
    return (frames[-1].line or "").lstrip().startswith("raise")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(torch.finfo(b.dtype).tiny))


def clipped_reference(grads: torch.Tensor, clips: torch.Tensor, stabilizer: float = 0.0):
    """(exact norms, clip factors w_i = min(1, c_i/(‖g_i‖ + stabilizer)), exact clipped sum Σ_i w_i g_i) of
    per-example gradients ``grads`` (B, P) at clip norms ``clips``; a whole step clips as Opacus does, with
    the stabilizer 1e-6 in the denominator (:data:`STABILIZER`)."""
    ref_norms = grads.norm(dim=1)
    w = torch.minimum(torch.ones_like(ref_norms), clips.to(ref_norms.dtype) / (ref_norms + stabilizer))
    return ref_norms, w, (w[:, None] * grads).sum(0)


STABILIZER = 1e-6  # the clip factor min(1, c / (‖g‖ + 1e-6)) of Opacus's and idpsgd's optimizers


def compare(params, grads, ref_norms, ref_sum, norms, sums, tol, elapsed) -> Outcome:
    """The outcome of an engine's (norms, {name: clipped sum}) against the exact ones (``norms`` None: the
    engine exposes none, only the clipped sum is compared): exact within ``tol`` relative, else WRONG
    with the relative errors and the parameter whose clipped sum is furthest off."""
    B = ref_norms.shape[0]
    if norms is not None and norms.shape != ref_norms.shape:
        return Outcome("WRONG", f"{norms.numel()} norms for {B} examples", seconds=elapsed)
    norm_err = 0.0 if norms is None else float(((norms.to(ref_norms.dtype) - ref_norms).abs() / ref_norms).max())
    flat = torch.cat([sums.get(n, torch.zeros_like(p)).to(p.dtype).reshape(-1) for n, p in params])
    unknown = sorted(set(sums) - {n for n, _ in params})
    sum_err = _rel(flat, ref_sum)
    if unknown:
        return Outcome("WRONG", f"clipped sum of untrained parameters {unknown[:3]}", norm_err, sum_err, elapsed)
    if not (norm_err <= tol and sum_err <= tol):  # (nan fails both comparisons)
        offsets = torch.tensor([0] + [p.numel() for _, p in params]).cumsum(0)
        worst = max(
            range(len(params)),
            key=lambda k: (
                _rel(flat[offsets[k] : offsets[k + 1]], ref_sum[offsets[k] : offsets[k + 1]])
                if ref_sum[offsets[k] : offsets[k + 1]].norm() > 0
                else float((flat[offsets[k] : offsets[k + 1]]).norm())
            ),
        )
        return Outcome(
            "WRONG",
            f"rel err norms {norm_err:.1e}, clipped sum {sum_err:.1e}; worst {params[worst][0]}",
            norm_err,
            sum_err,
            elapsed,
        )
    return Outcome("exact", "", norm_err, sum_err, elapsed)


def check(
    name: str, B: int, T: int, *, lora: bool = False, bf16: bool = False, mask: bool = False, mode: str | None = None
) -> Outcome:
    """Norms and clipped sum of the engine vs brute force (float64; ``bf16``: the engine under bf16 autocast on
    a float32 model, against the float32 reference, tolerance :data:`TOL_BF16`).  ``mode`` None: the
    book-keeper itself (:func:`engine_result`); else one step of that mode of :data:`MODES`
    (:func:`mode_result`)."""
    start = time.perf_counter()
    try:
        case = build(name, B, T, dtype=torch.float32 if bf16 else torch.float64, lora=lora, mask=mask)
        params, grads = reference(case)
    except Exception as exc:  # the harness or the model, not the engine
        return Outcome("error", _first_line(exc), seconds=time.perf_counter() - start)
    return check_case(case, params, grads, mode, bf16=bf16, start=start)


def check_case(
    case: Case, params, grads, mode: str | None, *, bf16: bool = False, start: float | None = None, floors=None
):
    """The engine (``mode``: see :func:`check`) on ``case`` against its reference (``params``, ``grads`` of
    :func:`reference`); ``floors``: a dict that keeps :func:`rounding_floor` per clip-norm kind between the
    modes of one case."""
    start = time.perf_counter() if start is None else start
    c = uniform_clip(grads) if mode in OPACUS_MODES else clip_norms(grads.shape[0], grads.norm(dim=1))
    ref_norms, w, ref_sum = clipped_reference(grads, c, 0.0 if mode is None else STABILIZER)
    try:
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with ctx:
            if mode is None:
                norms, sums = engine_result(case, lambda _norms: w.to(_norms.dtype))
            else:
                norms, sums = mode_result(case, mode, c)
    except Exception as exc:
        status = "refused" if _raised_by_engine(exc, OPACUS if mode in OPACUS_MODES else "idpsgd") else "crash"
        return Outcome(status, _first_line(exc), seconds=time.perf_counter() - start)
    tol = TOL_BF16 if bf16 else TOL_FLOAT64
    if mode is not None and not bf16:
        kind = mode in OPACUS_MODES
        floors = {} if floors is None else floors
        if kind not in floors:
            floors[kind] = rounding_floor(case, params, w, ref_sum)
        tol = max(tol, 10 * floors[kind])
    return compare(params, grads, ref_norms, ref_sum, norms, sums, tol, time.perf_counter() - start)


def rounding_floor(case: Case, params, w: torch.Tensor, ref_sum: torch.Tensor) -> float:
    """How far autograd's own gradient of Σ_i w_i L_i is from the reference Σ_i w_i g_i (relative), when that is
    rounding: a float64 model that computes in float32 inside (Llama's RMSNorm upcasts to float32 and back)
    rounds each backward pass at its scale, so an exact mode that backpropagates the clip-weighted losses
    (ghost's second pass) differs by float32 rounding.  0 when the gap is above 1e-5 (not rounding: the
    examples interact, and the tolerance must not hide it)."""
    model = copy.deepcopy(case.model)
    names = dict(params)
    trained = [p for n, p in model.named_parameters() if n in names]
    grads = torch.autograd.grad((w.to(ref_sum.dtype) * case.loss(model, case.inputs)).sum(), trained, allow_unused=True)
    flat = torch.cat(
        [(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(trained, grads, strict=True)]
    )
    gap = _rel(flat, ref_sum)
    return gap if gap <= 1e-5 else 0.0


# --- one step of each grad_sample_mode, idpsgd's and Opacus's own ------------------------------------
ENGINE_MODES = ("bk", "ghost", "hooks")  # idpsgd's make_private_with_parameters, per-example clip norms
OPACUS_MODES = ("opacus-hooks", "opacus-ghost")  # Opacus's own PrivacyEngine (one clip norm), for comparison
MODES = ENGINE_MODES + OPACUS_MODES
OPACUS = "opacus"


def uniform_clip(grads: torch.Tensor) -> torch.Tensor:
    """One clip norm for every example (Opacus takes one): the median exact norm (some clipped, some not)."""
    norms = grads.norm(dim=1)
    return norms.median().expand(norms.shape)


def mode_result(case: Case, mode: str, clips: torch.Tensor):
    """(per-example norms or None, {name: clipped sum}) of one noiseless step of ``mode`` on a copy of the
    case's model, as a user trains it: ``make_private`` over a data set of the batch's row indices (sampling
    rate 1: the Poisson batch is the whole batch), ``loss_reduction="sum"`` so that the optimizer's
    gradient *is* the clipped sum, the noise patched to 0, clip norm ``clips[i]`` for example ``i``
    (idpsgd's modes: :meth:`~idpsgd.IndividualizedPrivacyEngine.make_private_with_parameters`; Opacus's:
    its own ``PrivacyEngine`` with ``clips[0]`` for all, norms read from its per-sample gradients or
    ghost norms)."""
    import warnings
    from unittest import mock

    import numpy as np
    from torch.utils.data import DataLoader, TensorDataset

    from sensitivity_harness import _Criterion, _no_noise

    model = copy.deepcopy(case.model)
    B = next(iter(case.inputs.values())).shape[0]
    loader = DataLoader(TensorDataset(torch.arange(B)), batch_size=B)
    criterion = _Criterion(lambda losses, _target: losses)  # the model's call returns the per-example losses
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ghost = mode.endswith("ghost")
    with warnings.catch_warnings(), mock.patch("idpsgd.engine.noise.optimizer.gaussian_like", _no_noise):
        warnings.simplefilter("ignore")
        if mode in OPACUS_MODES:
            from opacus import PrivacyEngine

            engine = PrivacyEngine()
            out = engine.make_private(
                module=model,
                optimizer=opt,
                data_loader=loader,
                noise_multiplier=0.0,
                max_grad_norm=float(clips[0]),
                loss_reduction="sum",
                grad_sample_mode=mode.removeprefix("opacus-"),
                criterion=criterion,
            )
        else:
            from idpsgd import IndividualizedPrivacyEngine

            engine = IndividualizedPrivacyEngine(seed=0)
            out = engine.make_private_with_parameters(
                module=model,
                optimizer=opt,
                data_loader=loader,
                budgets=np.full(B, 1e4),
                target_delta=1e-5,
                sample_rates=np.ones(B),
                clip_norms=clips.double().numpy(),
                noise_multiplier=1.0,
                max_grad_norm=1.0,
                steps=1,
                grad_sample_mode=mode,
                privacy_filter=None,
                loss_reduction="sum",
                criterion=criterion if ghost else None,
            )
        module, optimizer, *rest = out
        wrapped_loss = rest[0] if ghost else None
        (idx,) = next(iter(rest[-1]))
        assert torch.equal(torch.sort(idx).values, torch.arange(B)), "sampling rate 1: the whole batch"
        inputs = {k: v[idx] for k, v in case.inputs.items()}
        optimizer.zero_grad()
        losses = case.loss(module, inputs)
        (wrapped_loss(losses, None) if ghost else losses.sum()).backward()
        norms = None
        if mode == "opacus-hooks":
            samples = [
                p.grad_sample.reshape(B, -1) for p in optimizer.params if getattr(p, "grad_sample", None) is not None
            ]
            norms = torch.cat(samples, 1).norm(dim=1)
        elif mode == "opacus-ghost":
            norms = module.per_sample_gradient_norms
        optimizer.step()
    if mode in ENGINE_MODES:
        norms = engine.clipping.last_norms
        idx = engine.clipping.last_indices
    order = torch.empty_like(idx)
    order[idx] = torch.arange(B)
    by_id = {id(p): n for n, p in model.named_parameters()}
    sums = {by_id[id(p)]: p.grad.detach() for p in optimizer.params if p.grad is not None}
    return (None if norms is None else norms.detach()[order]), sums


# --- idpsgd finetune on a model folder of each architecture -----------------------------------------
from hf_text import WORDS, word_tokenizer

GENERATIVE = DECODERS  # fine-tuned as causal language models; the others as sequence classifiers (3 classes)


def tokenizer():
    """A word-level tokenizer of :data:`WORDS` trained here ([PAD] 0, [UNK] 1, [EOS] 2, appended to each text)."""
    return word_tokenizer([" ".join(WORDS)], append_eos=True)


def save_model_folder(name: str, folder) -> None:
    """The float32 model of ``name`` as ``save_pretrained`` writes it, with :func:`tokenizer` (CLIP: its text
    model, CLIPTextModel, the Hugging Face class a user would save)."""
    case = build(name, 2, 8, dtype=torch.float32)
    model = case.model.text if isinstance(case.model, _CLIPTextClassifier) else case.model
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)


def finetune(name: str, root, *, lora_r: int = 0) -> tuple[int | str, str]:
    """Run ``idpsgd finetune`` (in process, the CLI's ``main``) on a saved folder of ``name`` and a JSONL file of
    16 rows (budgets 1 and 8; labels for classifiers): (exit code, or "traceback", and stderr's last line)."""
    import io
    import json
    import random
    from contextlib import redirect_stderr, redirect_stdout
    from pathlib import Path

    from idpsgd.cli.main import main

    root = Path(root)
    folder = root / f"{name}-model"
    if not folder.exists():
        save_model_folder(name, folder)
    rng = random.Random(0)
    rows = [
        {"text": " ".join(rng.choices(WORDS, k=rng.randint(3, 9))), "epsilon": 1.0 if i % 2 else 8.0, "label": i % 3}
        for i in range(16)
    ]
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["finetune", "--model", str(folder), "--data", str(data), "--method", "scale", "--epochs", "1"]
    argv += ["--batch-size", "4", "--max-length", "12", "--seed", "0", "--out", str(root / f"{name}-run{lora_r}")]
    argv += ["--overwrite", "--lora-r", str(lora_r)]
    if name not in GENERATIVE:
        argv += ["--label-column", "label", "--num-classes", "3"]
    err = io.StringIO()
    try:
        with redirect_stdout(io.StringIO()), redirect_stderr(err):
            code = main(argv)
    except Exception as exc:
        return "traceback", _first_line(exc, 300)
    lines = [line.replace(str(root), "…") for line in err.getvalue().splitlines() if line.strip()]
    return code, (lines[-1] if lines else "")


COLUMNS = ("T!=B", "T=B", "mask", "LoRA", "bf16")
MASKED = tuple(name for name in ALL if name not in (*VISION, "whisper_encoder"))  # the models with an attention mask


def run(name: str, column: str) -> Outcome:
    """One cell of the survey table: T ≠ B, T = B; or, at both shapes (the first outcome that is not exact,
    its shape case named, else exact): "mask" (a right-padded batch with its attention mask, text models),
    "LoRA" (models with attention), "bf16"."""
    if column in SHAPES:
        return check(name, *shape(name, column))
    if (column == "LoRA" and name not in LORA) or (column == "mask" and name not in MASKED):
        return Outcome("n/a")
    seconds, worst = 0.0, None
    for case_name in SHAPES:
        outcome = check(
            name, *shape(name, case_name), lora=column == "LoRA", bf16=column == "bf16", mask=column == "mask"
        )
        seconds += outcome.seconds
        if outcome.status != "exact" and worst is None:
            worst = dataclasses.replace(outcome, detail=f"[{case_name}] {outcome.detail}")
    return dataclasses.replace(worst or Outcome("exact"), seconds=seconds)


def survey(names=None, columns=COLUMNS, out=sys.stdout) -> dict:
    """Print the table (markdown) of architectures × columns; return {(name, column): Outcome}."""
    import warnings

    warnings.filterwarnings("ignore")
    names = list(names or ALL)
    table = {}
    print("| architecture | " + " | ".join(columns) + " |", file=out)
    print("|---" * (len(columns) + 1) + "|", file=out)
    for name in names:
        cells = []
        for column in columns:
            outcome = run(name, column)
            table[name, column] = outcome
            cells.append(str(outcome).replace("|", "/"))
        held = " (held out)" if name in HELD_OUT else ""
        print(f"| {name}{held} | " + " | ".join(cells) + " |", file=out, flush=True)
    return table


def finetune_survey(names=None, out=sys.stdout) -> dict:
    """Print the table (markdown) of ``idpsgd finetune`` per architecture, full and LoRA (r = 2)."""
    import tempfile
    import warnings

    warnings.filterwarnings("ignore")
    table = {}
    print("| architecture | task | finetune | finetune --lora-r 2 |", file=out)
    print("|---|---|---|---|", file=out)
    with tempfile.TemporaryDirectory() as root:
        for name in names or ALL:
            cells = []
            for r in (0, 2):
                code, line = finetune(name, root, lora_r=r)
                table[name, r] = code, line
                cells.append("exit 0" if code == 0 else f"{'exit ' if code != 'traceback' else ''}{code}: {line}")
            task = "causal LM" if name in GENERATIVE else "classifier"
            print(f"| {name} | {task} | " + " | ".join(c.replace("|", "/") for c in cells) + " |", file=out, flush=True)
    return table


if __name__ == "__main__":  # the command line is bench/survey_architectures.py's
    import runpy
    from pathlib import Path

    sys.argv[0] = str(Path(__file__).resolve().parents[1] / "bench" / "survey_architectures.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
