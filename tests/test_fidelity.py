"""bayesq.fidelity: streamed per-example scores against whole-tensor references, next-token NLL
against a hand loop, perplexity and paired intervals against direct bootstrap computations."""

import math

import pytest
import torch
from torch import nn

from bayesq.comparison import bootstrap_means, kl_per_example, percentile
from bayesq.fidelity import fidelity_report, next_token_nll, score_examples


class Classifier(nn.Module):
    def __init__(self, seed: int, d: int = 6, c: int = 4) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc = nn.Linear(d, c).double()
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(c, d, generator=g, dtype=torch.float64))

    def forward(self, x):
        return self.fc(x)


class TokenLM(nn.Module):
    """Per-token logits (B, T, V) of an embedding and a linear layer; reads the attention mask."""

    def __init__(self, seed: int, vocab: int = 7) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(vocab, 5).double()
        self.out = nn.Linear(5, vocab).double()
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(vocab, 5, generator=g, dtype=torch.float64))
            self.out.weight.copy_(torch.randn(vocab, 5, generator=g, dtype=torch.float64))

    def forward(self, input_ids, attention_mask=None):
        return self.out(self.embed(input_ids))


def test_score_examples_vs_whole_tensor_reference():
    fp, q = Classifier(0), Classifier(1)
    x = torch.randn(23, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    labels = torch.randint(0, 4, (23,), generator=torch.Generator().manual_seed(3))
    s = score_examples(fp, q, list(x.split(5)), labels, desc=None)
    with torch.no_grad():
        zp, zq = fp(x), q(x)
    assert torch.allclose(s.kl, kl_per_example(zp, zq), atol=1e-12)
    assert torch.equal(s.agree, (zp.argmax(1) == zq.argmax(1)).double())
    assert torch.equal(s.correct_fp, (zp.argmax(1) == labels).double())
    assert torch.equal(s.correct_q, (zq.argmax(1) == labels).double())
    assert s.nll_fp is None and s.n == 23


def test_next_token_nll_vs_hand_loop():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 5, 7, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 7, (2, 5), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    nll, count = next_token_nll(z, ids, mask)
    for b in range(2):
        real = int(mask[b].sum())
        want = -sum(torch.log_softmax(z[b, t], -1)[ids[b, t + 1]].item() for t in range(real - 1))
        assert nll[b].item() == pytest.approx(want, abs=1e-12)
        assert count[b].item() == real - 1


def test_perplexity_and_intervals_vs_direct_bootstrap():
    fp, q = TokenLM(0), TokenLM(1)
    g = torch.Generator().manual_seed(4)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, 7, (4, 6), generator=g)
        mask = torch.ones(4, 6, dtype=torch.long)
        mask[0, 4:] = 0
        batches.append({"input_ids": ids, "attention_mask": mask})
    s = score_examples(fp, q, batches, causal_lm=True, desc=None)
    r = fidelity_report(s, resamples=500, seed=7)
    # perplexity: exp(total NLL / total predicted tokens), each model
    assert r.perplexity_fp.value == pytest.approx(math.exp(float(s.nll_fp.sum() / s.tokens.sum())), rel=1e-12)
    assert r.perplexity_ratio.value == pytest.approx(r.perplexity_q.value / r.perplexity_fp.value, rel=1e-12)
    assert r.tokens == int(s.tokens.sum()) == 3 * (4 * 5 - 2)  # 5 predictions per row, 3 in the padded one
    # the ratio's interval from the same resamples, computed directly
    boot = bootstrap_means(torch.stack([s.nll_fp, s.nll_q, s.tokens], 1), 500, 7)
    ratio = ((boot[:, 1] - boot[:, 0]) / boot[:, 2]).exp().sort().values
    assert r.perplexity_ratio.low == pytest.approx(float(percentile(ratio, 0.025)), rel=1e-12)
    assert r.perplexity_ratio.high == pytest.approx(float(percentile(ratio, 0.975)), rel=1e-12)
    # the KL interval: bootstrap of the mean per-example KL
    kl = bootstrap_means(s.kl, 500, 7).sort().values
    assert r.kl.low == pytest.approx(float(percentile(kl, 0.025)), rel=1e-12)
    assert r.kl.low <= r.kl.value <= r.kl.high and r.kl.value > 0
    assert r.accuracy_diff is None
    d = r.as_dict()
    assert {"kl", "kl_ci_low", "perplexity_ratio_ci_high", "n", "tokens"} <= set(d) and "accuracy_q" not in d


def test_identical_models_score_zero_and_full_agreement():
    fp = Classifier(0)
    x = torch.randn(10, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    r = fidelity_report(score_examples(fp, fp, [x], torch.zeros(10, dtype=torch.long), desc=None), resamples=200)
    assert r.kl.value == 0 and r.agreement.value == 1 and r.accuracy_diff.value == 0
    assert r.accuracy_diff.low == r.accuracy_diff.high == 0


def test_score_examples_errors():
    fp = Classifier(0)
    x = torch.randn(5, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match="4 labels for at least 5 examples"):
        score_examples(fp, fp, [x], torch.zeros(4, dtype=torch.long), desc=None)
    lm = TokenLM(0)
    batch = {"input_ids": torch.zeros(2, 3, dtype=torch.long)}
    with pytest.raises(ValueError, match="per-token outputs"):
        score_examples(lm, lm, [batch], torch.zeros(2, dtype=torch.long), desc=None)
    with pytest.raises(ValueError, match="no test batches"):
        score_examples(fp, fp, [], desc=None)


def _base_bert(seed: int):
    """A base BERT from a config (no head: ``last_hidden_state``), float64."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                     max_position_embeddings=16)
    return BertModel(cfg).double().eval()


def test_score_examples_of_a_base_bert_gives_feature_measures_vs_whole_tensors():
    """A model without a head is scored on its features, not KL: the streamed per-example feature
    error, cosine of mean-pooled embeddings and nearest-neighbour agreement equal the whole-tensor
    references (neighbours over the whole test draw, across batches)."""
    from bayesq.comparison import cosine_per_example, feature_error_per_example, neighbour_agreement, pooled_embeddings

    fp = _base_bert(0)
    q = _base_bert(0)
    with torch.no_grad():
        for p in q.encoder.parameters():
            p.add_(0.3 * torch.randn_like(p))
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 40, (9, 6), generator=g)
    mask = torch.ones(9, 6, dtype=torch.long)
    mask[::2, 4:] = 0
    batches = [{"input_ids": ids[i:i + 4], "attention_mask": mask[i:i + 4]} for i in range(0, 9, 4)]
    s = score_examples(fp, q, batches, desc=None)
    assert s.kl is None and s.agree is None and s.features and s.n == 9
    with torch.no_grad():
        f_p, f_q = fp(input_ids=ids, attention_mask=mask).last_hidden_state, q(input_ids=ids, attention_mask=mask).last_hidden_state
    m = mask.bool()
    torch.testing.assert_close(s.feature_error, feature_error_per_example(f_p, f_q, m), rtol=1e-10, atol=0)
    e_p, e_q = pooled_embeddings(f_p, m), pooled_embeddings(f_q, m)
    torch.testing.assert_close(s.cosine, cosine_per_example(e_p, e_q), rtol=1e-10, atol=0)
    assert torch.equal(s.neighbour, neighbour_agreement(e_p, e_q).double())
    assert float(s.feature_error.min()) > 0 and float(s.cosine.max()) < 1
    report = fidelity_report(s, resamples=200)
    d = report.as_dict()
    assert "kl" not in d and {"feature_error", "cosine", "neighbour"} <= set(d)
    assert d["feature_error_ci_low"] <= d["feature_error"] <= d["feature_error_ci_high"]
    assert any(line.startswith("feature error") for line in report.lines())
    with pytest.raises(ValueError, match="no head.*drop the label column"):
        score_examples(fp, q, batches, labels=torch.zeros(9, dtype=torch.long), desc=None)
    with pytest.raises(ValueError, match="at least two"):
        score_examples(fp, q, [{"input_ids": ids[:1], "attention_mask": mask[:1]}], desc=None)
