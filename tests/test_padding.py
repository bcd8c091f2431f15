"""Dynamic padding moves no other example (issue 46, item 1).

A batch is padded to its longest row, so its length is a function of every example in it.  Two ways
that length reached other examples' gradients (the privacy review's figures): a left-padding tokenizer
with GPT-2 (positions counted from the batch's start; 2.81 × c) and a model that averages over every
position, pads included (``emb(ids).mean(1)``: 1.60–2.03 × c).  Now the shipped paths (``idpsgd
finetune``, the Trainer) lay every batch out on the right (a left-padded one is re-laid), a fixed public
length on request (``--pad-to-length``), and the batch-independence check re-pads its synthetic batch
(every example padded further, one example made longer) and refuses a model whose outputs on an
example's real tokens move.
"""

from __future__ import annotations

import json
from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn

from idpsgd.engine.guards.batch_independence import (
    BatchIndependence,
    BatchMixingError,
    Padding,
    check_batch_independence,
)
from idpsgd.engine.guards.padding_check import per_example_positions
from sensitivity_harness import MODES, Case, sensitivity

V, T = 20, 12  # vocabulary, stored length (each batch is cut to its longest row, as a padding collator does)


class Pool(nn.Module):
    """A bag-of-embeddings classifier: the mean over every position (pads included) or, ``masked``,
    over the real tokens only."""

    def __init__(self, masked: bool):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.fc, self.masked = nn.Embedding(V, 4), nn.Linear(4, 3), masked

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids)
        if self.masked:
            m = attention_mask.unsqueeze(-1).to(h.dtype)
            return self.fc((h * m).sum(1) / m.sum(1).clamp(min=1))
        return self.fc(h.mean(1))

    def save_pretrained(self, folder):  # what the Trainer's model/ folder needs of a model
        from pathlib import Path

        Path(folder).mkdir(parents=True, exist_ok=True)
        torch.save(self.state_dict(), Path(folder) / "model.pt")


def _dynamic(model, x):
    """Call the model on the batch cut to its longest row (right padding: DataCollatorWithPadding)."""
    ids, mask = x[:, 0], x[:, 1]
    longest = int(mask.sum(1).max())
    return model(input_ids=ids[:, :longest].contiguous(), attention_mask=mask[:, :longest].contiguous())


def _pool_case(masked: bool) -> Case:
    g = torch.Generator().manual_seed(1)
    n = 6
    lengths = torch.randint(2, 5, (n,), generator=g)
    ids = torch.randint(1, V, (n, T), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    x = torch.stack([ids * mask, mask], 1)
    y = torch.randint(0, 3, (n,), generator=g)

    def draw(gen):  # a long example: every position real
        return torch.stack([torch.randint(1, V, (T,), generator=gen), torch.ones(T, dtype=torch.long)]), torch.tensor(1)

    return Case(lambda: Pool(masked).double(), x, y, draw, call=_dynamic)


# --- the check: re-padded synthetic batches ---------------------------------------------------------
def _batch():
    mask = (torch.arange(6)[None] < torch.tensor([6, 5, 4, 6])[:, None]).long()
    return {"input_ids": torch.randint(3, V, (4, 6)) * mask, "attention_mask": mask}


def test_pooling_over_pads_is_refused_with_the_way_out():
    with pytest.raises(BatchMixingError, match="one example's length") as info:
        check_batch_independence(Pool(False).train(), (), _batch())
    message = str(info.value)
    assert "--pad-to-length" in message and "masked mean" in message and "padded on the right" in message


def test_the_masked_mean_and_a_fixed_length_are_accepted():
    check_batch_independence(Pool(True).train(), (), _batch())
    check_batch_independence(Pool(False).train(), (), _batch(), Padding(length=6))  # --pad-to-length: nothing varies
    with pytest.raises(BatchMixingError, match="fixes every batch's length at 8"):
        check_batch_independence(Pool(True).train(), (), _batch(), Padding(length=8))


def test_left_padding_without_positions_is_refused_and_with_them_accepted():
    pytest.importorskip("transformers")
    import hf_architectures as ha

    gpt2 = ha.tiny_model("gpt2").train()
    batch = _batch()
    check_batch_independence(gpt2, (), batch, Padding("right"))
    with pytest.raises(BatchMixingError, match="padded on the left"):
        check_batch_independence(gpt2, (), batch, Padding("left"))
    batch["position_ids"] = per_example_positions(batch["attention_mask"])
    check_batch_independence(gpt2, (), batch, Padding("left"))


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_pooling_over_pads_is_refused_in_training_before_any_noise(mode):
    case = _pool_case(masked=False)
    with pytest.raises(BatchMixingError, match="--pad-to-length"):
        sensitivity(case, mode, trials=1)


def test_pooling_over_pads_exceeds_the_clip_norm_without_the_check():
    """What the refusal prevents (review: 1.60–2.03 × c); the masked mean stays at c in every mode."""
    with mock.patch.object(BatchIndependence, "before_forward"):
        assert sensitivity(_pool_case(masked=False), "hooks", trials=2) > 1.2


@pytest.mark.parametrize("mode", [m for m in MODES if m != "ew"])  # ew's wrapper takes one positional input
def test_the_masked_mean_has_sensitivity_c(mode):
    s = sensitivity(_pool_case(masked=True), mode, c=0.5, trials=2)
    assert 0.99 * 0.5 < s <= 0.5 + 1e-9


# --- the shipped paths: finetune and the Trainer -------------------------------------------------------
@pytest.fixture(scope="module")
def left_gpt2(tmp_path_factory):
    """A tiny GPT-2 folder whose tokenizer pads on the left (as saved decoder tokenizers often do)."""
    pytest.importorskip("transformers")
    pytest.importorskip("datasets")
    import hf_architectures as ha
    from hf_text import WORDS, word_tokenizer

    folder = tmp_path_factory.mktemp("left") / "model"
    torch.manual_seed(0)
    ha.tiny_model("gpt2").save_pretrained(folder)
    tok = word_tokenizer([" ".join(WORDS)], append_eos=True)
    tok.padding_side = tok.init_kwargs["padding_side"] = "left"
    tok.save_pretrained(folder)
    return folder


def _texts(n, seed=0, low=2, high=6):
    from hf_text import WORDS

    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(low, high)))) for _ in range(n)]


def _finetune(folder, root, texts, *, c=1.0, mode="bk", **options):
    """(S: the clipped sum of one noiseless step over every row, the input_ids shapes the model saw)."""
    from idpsgd import Budgets
    from idpsgd.integrations.hf.finetune import FinetuneOptions, finetune
    from idpsgd.integrations.hf.text_data import load_text_data
    from idpsgd.integrations.hf.trainer import IndividualizedTrainer

    root.mkdir(parents=True, exist_ok=True)
    path = root / "train.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    sums, shapes = [], []

    def capture(std, reference, *args, **kwargs):
        sums.append(reference.detach().reshape(-1).clone())
        return torch.zeros_like(reference)

    compute_loss = IndividualizedTrainer.compute_loss

    def record(self, model, inputs, *args, **kwargs):
        if model.training:
            shapes.append(tuple(inputs["input_ids"].shape))
        return compute_loss(self, model, inputs, *args, **kwargs)

    opts = dict(method="uniform", epochs=1, batch_size=len(texts), max_grad_norm=c, grad_sample_mode=mode, seed=0)
    with (
        mock.patch("idpsgd.engine.noise.optimizer.gaussian_like", capture),
        mock.patch.object(IndividualizedTrainer, "compute_loss", record),
    ):
        finetune(
            folder,
            load_text_data(path),
            Budgets.from_array(np.full(len(texts), 4.0), 1e-5),
            root / "out",
            options=FinetuneOptions(**{**opts, **options}),
        )
    return torch.cat(sums), shapes


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_finetune_with_a_left_padding_tokenizer_moves_no_other_example(left_gpt2, tmp_path):
    """One long example added to D (sampling rate 1, noise 0): ‖S(D + z) − S(D)‖ ≤ c (main: 3.86 × c)."""
    texts = _texts(8)
    long_row = " ".join(_texts(1, seed=9, low=20, high=21))
    c = 0.5
    a, _ = _finetune(left_gpt2, tmp_path / "D", texts, c=c)
    b, _ = _finetune(left_gpt2, tmp_path / "Dz", [*texts, long_row], c=c)
    assert float((b - a).norm()) <= c * (1 + 1e-6)
    assert float((b - a).norm()) > 0.99 * c  # z's gradient is clipped to c: the harness reaches it


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_finetune_pad_to_length_gives_every_batch_the_same_shape(left_gpt2, tmp_path, capsys):
    from idpsgd.cli.main import main

    texts = _texts(12, low=2, high=9)
    _, shapes = _finetune(left_gpt2, tmp_path / "fixed", texts, max_length=16, pad_to_length=16, batch_size=4, epochs=2)
    assert len(shapes) >= 4 and {s[1] for s in shapes} == {16}
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    argv = ["finetune", "--model", str(left_gpt2), "--data", str(data), "--method", "uniform", "--budgets", "4"]
    argv += ["--max-length", "32", "--pad-to-length", "16", "--out", str(tmp_path / "bad")]
    assert main(argv) == 2
    assert "pad-to-length" in capsys.readouterr().err  # refused: --max-length 32 does not fit in 16


def test_the_collator_lays_batches_out_on_the_right():
    pytest.importorskip("transformers")
    from idpsgd.integrations.hf.padding import PublicPadding

    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]])
    ids = torch.tensor([[0, 0, 5, 6], [4, 5, 6, 7], [0, 8, 9, 10]])
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)}
    out = PublicPadding(lambda f: f, pad_to_length=6, pad_token_id=0)(batch)
    assert out["input_ids"].tolist() == [[5, 6, 0, 0, 0, 0], [4, 5, 6, 7, 0, 0], [8, 9, 10, 0, 0, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]]
    assert out["labels"][0].tolist() == [5, 6, -100, -100, -100, -100]
    assert "position_ids" not in out  # right padding: every model's own positions are per example
    with pytest.raises(ValueError, match="pad_to_length"):
        PublicPadding(lambda f: f, pad_to_length=3, pad_token_id=0)(batch)
    with pytest.raises(ValueError, match="'position_ids'"):  # a collator's own positions are not re-laid
        PublicPadding(lambda f: f)({**batch, "position_ids": torch.arange(4).expand(3, 4)})


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_trainer_refuses_pooling_over_pads_unless_the_length_is_fixed(tmp_path):
    pytest.importorskip("transformers")
    datasets = pytest.importorskip("datasets")
    from transformers import DataCollatorWithPadding, TrainingArguments

    from hf_text import word_tokenizer
    from idpsgd.integrations.hf import IndividualizedTrainer, PrivacyArguments

    texts = _texts(16, low=2, high=9)
    tok = word_tokenizer(texts)
    enc = tok(texts, truncation=True, max_length=12)
    train = datasets.Dataset.from_dict({**enc, "labels": [i % 3 for i in range(16)]})

    long = _texts(4, seed=5, low=14, high=16)  # public held-out rows longer than the training batches' fixed length
    test = datasets.Dataset.from_dict({**tok(long), "labels": [0, 1, 2, 0]})

    def trainer(out, **privacy):
        args = TrainingArguments(
            output_dir=str(out),
            per_device_train_batch_size=4,
            num_train_epochs=1,
            save_strategy="no",
            use_cpu=True,
            report_to=[],
            disable_tqdm=True,
            remove_unused_columns=False,
        )
        return IndividualizedTrainer(
            model=Pool(False),
            args=args,
            train_dataset=train,
            eval_dataset=test,
            processing_class=tok,
            data_collator=DataCollatorWithPadding(tok),
            per_example_loss=lambda out, y: nn.functional.cross_entropy(out, y, reduction="none"),
            privacy=PrivacyArguments(budgets=np.full(16, 2.0), delta=1e-5, method="uniform", seed=0, **privacy),
        )

    with pytest.raises(BatchMixingError, match="pad_to_length"):
        trainer(tmp_path / "dynamic").train()
    fixed = trainer(tmp_path / "fixed", pad_to_length=12)
    fixed.train()
    assert fixed.report["test_metrics"]["test_examples"] == 4  # evaluated, not refused
    with pytest.raises(ValueError, match="shorter than some training rows"):
        trainer(tmp_path / "short", pad_to_length=4)
