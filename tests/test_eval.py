"""Evaluation: retrieval maths against a brute-force reference, zero-shot, CLIP score, probe,
the evaluator over real shards and `mmtrain eval` end to end."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import mmtrain
from mmtrain.cli import main
from mmtrain.data.storage.manifest import write_manifest
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.eval import (
    Evaluator,
    ZeroShotConfig,
    clip_score,
    evaluate,
    flatten_metrics,
    linear_probe,
    macro_f1,
    rank_metrics,
    retrieval_metrics,
    retrieval_ranks,
)
from mmtrain.eval.retrieval import query_share
from mmtrain.eval.zeroshot import class_embeddings, zeroshot_metrics


# ----------------------------------------------------------------------------- reference
def brute_force_ranks(q: torch.Tensor, c: torch.Tensor, qids=None, cids=None) -> torch.Tensor:
    """The documented rule, one query and one candidate at a time, from the full N x N matrix."""
    scores = (q.double() @ c.double().t()).tolist()
    qids = list(range(len(q))) if qids is None else qids.tolist()
    cids = list(range(len(c))) if cids is None else cids.tolist()
    ranks = []
    for i, row in enumerate(scores):
        matches = [k for k in range(len(c)) if cids[k] == qids[i]]
        best = max(row[k] for k in matches)
        j = min(k for k in matches if row[k] == best)
        ranks.append(
            sum(
                1
                for k in range(len(c))
                if cids[k] != qids[i] and (row[k] > best or (row[k] == best and k < j))
            )
        )
    return torch.tensor(ranks)


def integer_embeddings(n: int, d: int, seed: int) -> torch.Tensor:
    """Small-integer vectors: dot products are exact and ties are frequent."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2, 3, (n, d), generator=g).float()


@pytest.mark.parametrize("chunk_elements", [1, 7 * 23, 1 << 20])
def test_ranks_match_brute_force_with_ties_and_uneven_chunks(chunk_elements):
    q, c = integer_embeddings(23, 3, 0), integer_embeddings(23, 3, 1)
    expected = brute_force_ranks(q, c)
    got = retrieval_ranks(q, c, chunk_elements=chunk_elements)
    assert torch.equal(got, expected)
    # ties really occur in this data, so the tie rule is exercised
    scores = q @ c.t()
    assert any(int((scores[i] == scores[i, i]).sum()) > 1 for i in range(23))


def test_ranks_with_several_matches_per_query():
    images, captions = integer_embeddings(9, 3, 2), integer_embeddings(20, 3, 3)
    owner = torch.arange(20) % 9  # caption k describes image k % 9
    image_ids = torch.arange(9)
    i2t = retrieval_ranks(images, captions, image_ids, owner, chunk_elements=17)
    t2i = retrieval_ranks(captions, images, owner, image_ids, chunk_elements=17)
    assert torch.equal(i2t, brute_force_ranks(images, captions, image_ids, owner))
    assert torch.equal(t2i, brute_force_ranks(captions, images, owner, image_ids))


def test_query_range_and_errors():
    q, c = integer_embeddings(10, 4, 4), integer_embeddings(10, 4, 5)
    full = retrieval_ranks(q, c)
    assert torch.equal(retrieval_ranks(q, c, start=3, stop=8), full[3:8])
    with pytest.raises(ValueError, match="no true match"):
        retrieval_ranks(q, c, torch.zeros(10), torch.ones(10))
    with pytest.raises(ValueError, match="candidate_ids"):
        retrieval_ranks(q, c[:5])
    with pytest.raises(ValueError, match="NaN"):
        retrieval_metrics({"a": q, "b": c.clone().fill_(float("nan"))}, [("a", "b")])


def test_query_shares_cover_all_queries_evenly():
    for n in (0, 1, 7, 10):
        for world in (1, 2, 3):
            shares = [query_share(n, r, world) for r in range(world)]
            assert shares[0][0] == 0 and shares[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(shares, shares[1:], strict=False))
            sizes = [hi - lo for lo, hi in shares]
            assert max(sizes) - min(sizes) <= 1


def test_rank_metrics_values():
    m = rank_metrics(torch.tensor([0, 0, 3, 9, 12]))
    assert m["R@1"] == pytest.approx(0.4)
    assert m["R@5"] == pytest.approx(0.6)
    assert m["R@10"] == pytest.approx(0.8)
    assert m["mean_rank"] == pytest.approx((1 + 1 + 4 + 10 + 13) / 5)
    assert m["median_rank"] == 4.0
    assert m["n_queries"] == 5
    assert rank_metrics(torch.tensor([0, 3]))["median_rank"] == 2.5


def test_perfect_embeddings_give_recall_one():
    x = F.normalize(torch.randn(50, 16, generator=torch.Generator().manual_seed(0)), dim=-1)
    out = retrieval_metrics({"image": x, "text": x.clone()}, [("image", "text")], chunk_elements=64)
    for direction in ("image->text", "text->image"):
        assert out[direction]["R@1"] == 1.0
        assert out[direction]["mean_rank"] == 1.0
        assert out[direction]["median_rank"] == 1.0
        assert out[direction]["n_queries"] == 50


def test_random_embeddings_give_chance_recall():
    n = 1000
    g = torch.Generator().manual_seed(1)
    a = F.normalize(torch.randn(n, 32, generator=g), dim=-1)
    b = F.normalize(torch.randn(n, 32, generator=g), dim=-1)
    out = retrieval_metrics({"a": a, "b": b}, [("a", "b")], chunk_elements=50_000)
    for direction in ("a->b", "b->a"):
        m = out[direction]
        for k in (1, 5, 10):  # binomial std of R@10 is about 0.0095
            assert abs(m[f"R@{k}"] - k / n) < 0.03
        assert abs(m["mean_rank"] - (n + 1) / 2) < 60


# ----------------------------------------------------------------------------- zero-shot
def test_zeroshot_on_constructed_embeddings():
    classes = torch.eye(4)  # class c points along axis c
    labels = torch.tensor([0, 1, 2, 3, 0, 1])
    features = torch.eye(4)[labels] * 2.0
    features[5] = torch.tensor([0.0, 0.9, 1.0, 0.0])  # label 1, but class 2 scores higher
    m = zeroshot_metrics(features, labels, classes, ks=(1, 2), chunk_elements=5)
    assert m["top1"] == pytest.approx(5 / 6)
    assert m["top2"] == 1.0
    assert m["n_samples"] == 6
    with pytest.raises(ValueError, match="class indices"):
        zeroshot_metrics(features, labels + 4, classes)


def test_class_embeddings_average_normalised_templates():
    table = {"a x": [3.0, 0.0], "b x": [0.0, 1.0], "a y": [0.0, 5.0], "b y": [1.0, 0.0]}

    def embed(texts):
        return torch.tensor([table[t] for t in texts])

    out = class_embeddings(embed, ["x", "y"], ["a {}", "b {}"])
    s = 2**-0.5
    assert torch.allclose(out, torch.tensor([[s, s], [s, s]]))  # mean of unit vectors, renormalised


# ----------------------------------------------------------------------------- CLIP score
def test_clip_score_is_floored_scaled_cosine():
    a = torch.tensor([[1.0, 0.0], [1.0, 0.0], [2.0, 2.0], [1.0, 0.0]])
    b = torch.tensor([[3.0, 0.0], [-1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    s = clip_score(a, b)
    assert s.tolist() == pytest.approx([100.0, 0.0, 100 * 2**-0.5, 0.0], abs=1e-4)
    with pytest.raises(ValueError):
        clip_score(a, b[:2])


# ----------------------------------------------------------------------------- probe
def test_probe_learns_a_separable_problem():
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(3, 8, generator=g) * 4
    labels = torch.arange(300) % 3
    x = centres[labels] + torch.randn(300, 8, generator=g) * 0.5
    out = linear_probe(x[:200], labels[:200], x[200:], labels[200:])
    assert out["accuracy"] == 1.0 and out["macro_f1"] == 1.0
    assert out["n_train"] == 200 and out["n_test"] == 100
    # determinism: the fit has no randomness
    assert linear_probe(x[:200], labels[:200], x[200:], labels[200:]) == out


def test_macro_f1_weights_classes_equally():
    labels = torch.tensor([0, 0, 0, 0, 1])
    predictions = torch.tensor([0, 0, 0, 0, 0])
    # class 0: P 4/5, R 1 -> F1 8/9; class 1: F1 0
    assert macro_f1(predictions, labels) == pytest.approx((8 / 9) / 2)


# ----------------------------------------------------------------------------- real data
def make_shards(folder, n: int, per_shard: int = 4, labels: bool = False, corrupt=()):
    """n image-caption samples: colour i / n, caption naming it; label = i % 3."""
    names = ["red", "green", "blue"]
    with ShardWriter(folder, max_samples=per_shard) as writer:
        for i in range(n):
            colour = (int(255 * i / n), 80, 255 - int(255 * i / n))
            buf = io.BytesIO()
            Image.new("RGB", (40, 32), colour).save(buf, format="PNG")
            sample = {"__key__": f"s{i:04d}", "png": buf.getvalue(), "txt": f"a {names[i % 3]} {i}"}
            if i in corrupt:
                sample["png"] = b"not an image"
            if labels:
                sample["json"] = json.dumps({"label": names[i % 3]})
            writer.write(sample)
        shards = writer.close()
    write_manifest(folder, shards, classes=names)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_clip():
    torch.manual_seed(0)
    return mmtrain.create_model("tiny-clip", seed=3).eval()


def test_evaluator_independent_of_batch_size_and_skips_corrupt(tmp_path, tiny_clip):
    data = make_shards(tmp_path / "d", 11, corrupt=(4,))
    first = Evaluator(tiny_clip.spec, data, batch_size=4).report(tiny_clip)
    second = Evaluator(tiny_clip.spec, data, batch_size=3).report(tiny_clip)
    assert first["n_samples"] == 10  # 11 minus the corrupt one; padding repeats removed
    assert first["retrieval"]["image->text"]["n_queries"] == 10
    assert first["corrupt_samples"] >= 1
    for key in ("retrieval", "clip_score"):
        assert flatten_metrics(first[key]) == pytest.approx(flatten_metrics(second[key]))


def test_evaluate_flat_metrics_and_training_mode_restored(tmp_path, tiny_clip):
    model = mmtrain.create_model("tiny-clip", seed=1)
    model.train()
    data = make_shards(tmp_path / "d", 6)
    evaluator = Evaluator(model.spec, data, batch_size=4)
    flat = evaluator(model)
    assert model.training
    assert set(flat) >= {
        "n_samples",
        "retrieval/image->text/R@1",
        "retrieval/text->image/median_rank",
        "clip_score/image-text/mean",
    }
    # the same numbers from evaluate() over the loader, and again on a second call
    evaluator.loader.set_epoch(0)
    assert evaluate(model, evaluator.loader) == pytest.approx(
        {k: v for k, v in flat.items() if k != "corrupt_samples"}
    )
    assert evaluator(model) == flat
    evaluator.close()


def test_zeroshot_and_probe_on_shards(tmp_path, tiny_clip):
    data = make_shards(tmp_path / "d", 15, labels=True)
    zs = ZeroShotConfig(["red", "green", "blue"], ["a {}", "{} colour"])
    report = Evaluator(tiny_clip.spec, data, batch_size=8, zeroshot=zs, probe=True).report(
        tiny_clip
    )
    z = report["zeroshot"]["image"]
    assert z["n_samples"] == 15 and z["n_classes"] == 3 and 0 <= z["top1"] <= 1
    assert "top5" not in z  # k above the number of classes is left out
    p = report["probe"]
    assert p["n_train"] + p["n_test"] == 15 and p["split"] == "key-hash"
    assert p["towers"] == ["image", "text"]


# ----------------------------------------------------------------------------- CLI
@pytest.fixture()
def model_dir(tmp_path, tiny_clip):
    return mmtrain.save_model(tiny_clip, tmp_path / "run")


def test_cli_writes_eval_json(tmp_path, model_dir, capsys):
    data = make_shards(tmp_path / "d", 9, labels=True)
    code = main(["eval", str(model_dir), "--data", data, "--batch-size", "4", "--zeroshot"])
    assert code == 0
    report = json.loads((model_dir / "eval.json").read_text())
    for direction in ("image->text", "text->image"):
        m = report["retrieval"][direction]
        assert m["n_queries"] == 9
        assert 0 <= m["R@1"] <= m["R@5"] <= m["R@10"] <= 1
        assert 1 <= m["median_rank"] <= 9 and 1 <= m["mean_rank"] <= 9
    assert report["zeroshot"]["image"]["n_classes"] == 3
    assert report["model_name"] == "tiny-clip"
    printed = capsys.readouterr().out
    assert "image->text" in printed and "eval.json" in printed

    out = tmp_path / "elsewhere" / "e.json"
    assert main(["eval", str(model_dir), "--data", data, "--json", "--out", str(out)]) == 0
    assert (
        json.loads(capsys.readouterr().out)["retrieval"] == json.loads(out.read_text())["retrieval"]
    )


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--data", "{tmp}/missing"], "--data"),
        (["--data", "{data}", "--pairs", "image-audio"], "audio"),
        (["--data", "{data}", "--batch-size", "0"], "--batch-size"),
        (["--data", "{data}", "--zeroshot-classes", "{tmp}/nope.txt"], "nope.txt"),
    ],
)
def test_cli_bad_input_exits_2(tmp_path, model_dir, capsys, extra, needle):
    data = make_shards(tmp_path / "d", 3)
    args = [a.format(tmp=tmp_path, data=data) for a in extra]
    assert main(["eval", str(model_dir), *args]) == 2
    assert needle in capsys.readouterr().err


def test_cli_probe_on_separate_training_shards(tmp_path, model_dir):
    test = make_shards(tmp_path / "test", 6, labels=True)
    train = make_shards(tmp_path / "train", 9, labels=True)
    args = ["eval", str(model_dir), "--data", test, "--probe", "--probe-train", train]
    assert main([*args, "--pairs", "image-text"]) == 0
    probe = json.loads((model_dir / "eval.json").read_text())["probe"]
    assert (probe["n_train"], probe["n_test"], probe["split"]) == (9, 6, "given")


def test_cli_labels_missing_exits_2(tmp_path, model_dir, capsys):
    data = make_shards(tmp_path / "d", 3)  # no labels
    assert main(["eval", str(model_dir), "--data", data, "--probe"]) == 2
    err = capsys.readouterr().err
    assert "data:" in err and "no label" in err


def test_cli_missing_model_exits_2(tmp_path, capsys):
    data = make_shards(tmp_path / "d", 3)
    (tmp_path / "empty").mkdir()
    assert main(["eval", str(tmp_path / "empty"), "--data", data]) == 2
    assert "spec.yaml" in capsys.readouterr().err


def test_numpy_median_convention():
    ranks = torch.tensor([5, 1, 8, 2])
    assert rank_metrics(ranks)["median_rank"] == float(np.median(ranks.numpy() + 1))


def test_cli_evaluates_a_checkpoint_and_a_run_still_training(tmp_path, capsys):
    from micro import make_shards, micro_run
    from mmtrain.checkpoint import verify_checkpoint
    from mmtrain.train.loop import train

    shards = make_shards(tmp_path / "shards", 16)
    run = tmp_path / "run"
    train(micro_run(tmp_path, shards), halt_after_step=3)  # "killed": no final weights yet
    step2 = run / "checkpoints" / "step_00000002"
    assert not (run / "model.safetensors").exists() and verify_checkpoint(step2) == []

    assert main(["eval", str(run), "--data", shards, "--json"]) == 0  # its newest checkpoint
    report = json.loads((run / "eval-step_00000002.json").read_text())
    assert report["model"] == str(step2)
    assert report["retrieval"]["image->text"]["n_queries"] == 16
    capsys.readouterr()

    out = tmp_path / "direct.json"
    assert main(["eval", str(step2), "--data", shards, "--json", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["retrieval"] == report["retrieval"]
    assert verify_checkpoint(step2) == []  # nothing was written into the checkpoint

    assert main(["eval", str(tmp_path / "shards"), "--data", shards]) == 2  # not a model
    assert "no valid checkpoint" in capsys.readouterr().err
