"""The Factbook corpus/QA builder and the FlashRAG QA and corpus loaders."""

import json
import re
import statistics
from collections import Counter
from pathlib import Path

import pytest

from zerosim.core.data import DataError, QAExample, build_factbook, factbook, load_corpus, load_qa
from zerosim.core.metrics import normalize_answer

SPLITS = ("train", "dev", "test")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The full build, done twice (for the determinism check) once per test module."""
    first = build_factbook(tmp_path_factory.mktemp("a") / "factbook", progress=False)
    second = build_factbook(tmp_path_factory.mktemp("b") / "factbook", seed=0, progress=False)
    return first, second


@pytest.fixture(scope="module")
def corpus(built) -> dict[str, str]:
    return {row["id"]: row["contents"] for row in read_jsonl(built[0].corpus)}


@pytest.fixture(scope="module")
def questions(built) -> dict[str, list[dict]]:
    return {split: read_jsonl(getattr(built[0], split)) for split in SPLITS}


def passage_with(corpus: dict[str, str], field_prefix: str) -> str:
    """The id of the one passage holding the field that starts ``field_prefix`` ("Peru - Government - Capital: ")."""
    hits = [
        pid
        for pid, contents in corpus.items()
        if f"\n{field_prefix}" in contents or f" | {field_prefix}" in contents
    ]
    assert len(hits) == 1, (field_prefix, hits)
    return hits[0]


@pytest.fixture
def few_entries(monkeypatch):
    """Make the builder see only Peru, Spain, Chile and the World entry: a build in a fraction of a second."""
    files = [(code, raw) for code, raw in factbook._data_files() if code in {"pe", "sp", "ci", "xx"}]
    monkeypatch.setattr(factbook, "_data_files", lambda: files)


# ------------------------------------------------------------------------------------------- builder


def test_build_is_byte_identical(built):
    first, second = built
    for name in ("corpus", *SPLITS):
        a, b = getattr(first, name).read_bytes(), getattr(second, name).read_bytes()
        assert a == b, f"{name}.jsonl differs between two builds"
        assert b"\r" not in a and a.endswith(b"\n")


def test_counts_match_files(built, corpus, questions):
    paths = built[0]
    assert 10_000 < paths.num_passages == len(corpus) < 20_000  # ~33 k fields packed into ~100-word passages
    assert (paths.num_train, paths.num_dev, paths.num_test) == tuple(len(questions[s]) for s in SPLITS)


def test_corpus_rows_are_flashrag(built):
    row = json.loads(built[0].corpus.read_text(encoding="utf-8").splitlines()[0])
    assert set(row) == {"id", "contents"}
    title, text = row["contents"].split("\n", 1)
    assert text.startswith((f"{title} - ", f"{title}: "))  # a packed section, or a chunk of one long field


def test_passages_are_about_100_words(corpus):
    words = [len(contents.split("\n", 1)[1].split()) for contents in corpus.values()]
    assert max(words) <= factbook.MAX_PASSAGE_WORDS <= 160
    assert 60 <= statistics.median(words) <= 120
    packed = [c for c in corpus.values() if factbook.FIELD_SEP in c.split("\n", 1)[1]]
    assert len(packed) > len(corpus) / 2
    for contents in packed:
        assert len(contents.split("\n", 1)[1].split()) <= factbook.PACK_WORDS
    # long fields are cut into several chunks, each titled by its field and repeating its prefix
    background = [c for c in corpus.values() if c.startswith("Peru - Introduction - Background\n")]
    assert len(background) >= 2
    assert all(c.split("\n", 1)[1].startswith("Peru - Introduction - Background: ") for c in background)
    assert corpus["pe-introduction-1"] == background[1]
    chunked = [pid for pid, c in corpus.items() if c.split("\n", 1)[0].count(" - ") >= 2]
    assert len(chunked) > 500


def test_passage_packing():
    def words(n: int, word: str) -> dict:
        return {"text": " ".join(f"{word}{i}." if i % 20 == 19 else f"{word}{i}" for i in range(n))}

    tree = {
        "Government": {
            "A": words(40, "a"),
            "B": words(30, "b"),
            "C": words(50, "c"),
            "Long": words(400, "l"),
        },
        "Economy": {"D": {"text": "x"}, "E": {"name": {"text": "y"}, "note": "z"}},
    }
    passages = factbook.entry_passages("zz", "Zedland", tree)
    assert [p.id for p in passages][:2] == ["zz-government-0", "zz-government-1"]
    assert passages[-1].id == "zz-economy-0"
    assert [p.fields for p in passages][:2] == [("A", "B"), ("C",)]  # whole fields, in order, <= PACK_WORDS
    assert passages[0].title == "Zedland - Government"
    assert passages[0].text == (
        f"Zedland - Government - A: {tree['Government']['A']['text']}"
        f" | Zedland - Government - B: {tree['Government']['B']['text']}"
    )
    chunks = [p for p in passages if p.fields == ("Long",)]
    assert len(chunks) == 4 and [p.id for p in chunks] == [f"zz-government-{i}" for i in range(2, 6)]
    assert all(p.title == "Zedland - Government - Long" for p in chunks)
    assert all(p.text.startswith("Zedland - Government - Long: ") for p in chunks)
    assert (
        " ".join(p.text.removeprefix("Zedland - Government - Long: ") for p in chunks)
        == words(400, "l")["text"]
    )
    assert all(90 <= len(p.text.split()) <= 130 for p in chunks)
    assert passages[-1].text == "Zedland - Economy - D: x | Zedland - Economy - E: name: y; note: z"
    assert factbook._pack([50, 50, 50], 110) == [2, 1] and factbook._pack([60, 60, 10], 110) == [1, 2]
    assert factbook._pack([100, 5, 5, 5, 5], 110) == [1, 4] and factbook._pack([], 110) == []


def test_every_passage_names_its_country(corpus):
    stray = []
    for pid, contents in corpus.items():
        title, text = contents.split("\n", 1)
        country = title.split(" - ")[0]
        assert text.startswith(f"{country} - "), pid
        assert country.lower() != "none", pid
        # every packed field keeps its own prefix
        stray += [s for s in text.split(factbook.FIELD_SEP) if not s.startswith(f"{country} - ")]
    assert len(stray) <= 10, (
        stray
    )  # a handful of raw values ("Home | Malawi Embassy USA") hold " | " themselves
    # overrides for entries whose short name is "none", an abbreviation or a fragment
    ae = passage_with(corpus, "United Arab Emirates - Government - Capital: ")
    assert corpus[ae].startswith("United Arab Emirates - Government\n")
    assert passage_with(corpus, "Democratic Republic of the Congo - Government - Capital: ").startswith("cg-")
    assert passage_with(corpus, "Dominican Republic - Government - Capital: ").startswith("dr-")
    assert corpus["xx-introduction-0"].startswith("World - Introduction - Background\nWorld - ")
    peru = corpus[passage_with(corpus, "Peru - Government - Capital: ")]
    assert "Peru - Government - Capital: name: Lima; " in peru


def test_no_html_left(corpus):
    for pid, contents in corpus.items():
        assert not re.search(r"<[A-Za-z/]|&[A-Za-z]+;|&#\d+;", contents), pid
    assert "Perú" in corpus["pe-government-0"]  # &uacute; decoded


def test_clean_html():
    assert factbook.clean_html("Catholic &lt;1%, <strong>note:</strong> x") == "Catholic <1%, note: x"
    assert factbook.clean_html("a&amp;nbsp;b") == "a b"  # double-escaped entity
    assert factbook.clean_html("one<br><br>two <em>Rimak</em>,") == "one two Rimak,"


def test_peru_questions(corpus, questions):
    rows = {row["id"]: row for split in SPLITS for row in questions[split]}
    expected = {
        "pe-capital": "Lima",
        "pe-internet_code": ".pe",
        "pe-government_type": "presidential republic",
        "pe-independence": "28 July 1821",
        "pe-currency": "nuevo sol",
        "pe-nationality": "Peruvian",
        "pe-long_form": "Republic of Peru",
        "pe-capital_via_internet_code": "Lima",
    }
    for qid, answer in expected.items():
        assert rows[qid]["golden_answers"] == [answer], qid
        assert rows[qid]["metadata"]["country"] == "Peru"
    assert "Peru" in rows["pe-capital"]["question"]
    two_hop = rows["pe-capital_via_internet_code"]
    assert two_hop["question"].endswith("the country whose internet country code is .pe?")
    assert "Peru" not in two_hop["question"]
    assert two_hop["metadata"]["hops"] == 2
    # bridge evidence first, then the passage the answer was taken from
    assert two_hop["metadata"]["passage_ids"][:2] == ["pe-communications-1", "pe-government-1"]
    assert rows["pe-capital"]["metadata"]["passage_ids"][0] == "pe-government-1"


def test_every_gold_answer_is_in_its_passages(corpus, questions):
    for split in SPLITS:
        for row in questions[split]:
            assert set(row) == {"id", "question", "golden_answers", "metadata"}
            meta = row["metadata"]
            assert set(meta) == {"kind", "hops", "country", "passage_ids"}
            assert meta["passage_ids"], row["id"]
            texts = [normalize_answer(corpus[pid]) for pid in meta["passage_ids"]]
            assert all(normalize_answer(meta["country"]) in t for t in texts), row["id"]
            for answer in row["golden_answers"]:
                assert answer and answer == answer.strip()
                assert any(normalize_answer(answer) in t for t in texts), row["id"]
                assert f" {normalize_answer(answer)} " not in f" {normalize_answer(row['question'])} ", row[
                    "id"
                ]


def test_several_kinds_and_two_hop(questions):
    rows = [row for split in SPLITS for row in questions[split]]
    one_hop = Counter(r["metadata"]["kind"] for r in rows if r["metadata"]["hops"] == 1)
    two_hop = Counter(r["metadata"]["kind"] for r in rows if r["metadata"]["hops"] == 2)
    assert len(one_hop) >= 7 and min(one_hop.values()) >= 20
    assert one_hop["capital"] > 150 and one_hop["internet_code"] > 150
    assert len(two_hop) >= 3 and sum(two_hop.values()) > 300
    for split in SPLITS:  # two-hop questions land in every split
        assert any(r["metadata"]["hops"] == 2 for r in questions[split]), split
    assert not any(r["metadata"]["country"] in r["question"] for r in rows if r["metadata"]["hops"] == 2)


def test_splits_are_sane_and_disjoint(questions):
    sizes = {split: len(questions[split]) for split in SPLITS}
    total = sum(sizes.values())
    assert total > 1500
    assert 0.7 < sizes["train"] / total < 0.9
    assert 0.05 < sizes["dev"] / total < 0.15 and 0.05 < sizes["test"] / total < 0.15
    ids = [row["id"] for split in SPLITS for row in questions[split]]
    texts = [row["question"] for split in SPLITS for row in questions[split]]
    assert len(set(ids)) == len(ids)
    assert len(set(texts)) == len(texts)
    for split in SPLITS:
        assert all(factbook.split_of(row["id"]) == split for row in questions[split])
        assert [row["id"] for row in questions[split]] == sorted(row["id"] for row in questions[split])


def test_fact_splits_share_no_fact(built, questions):
    """fact-train / fact-test hold the same questions as train + dev + test, split by country: no (country,
    attribute) fact of a held-out question — its answer's or its bridge's — is asked or used in training; at
    least 500 held-out questions, both hops among them. The question-id split shares facts (why this exists)."""
    fact = {s: read_jsonl(getattr(built[0], s.replace("-", "_"))) for s in ("fact-train", "fact-test")}

    def facts(row: dict) -> set[tuple[str, str]]:
        code = row["id"].split("-")[0]
        answer, _, bridge = row["metadata"]["kind"].partition("_via_")
        return {(code, answer), *([(code, bridge)] if bridge else [])}

    def all_facts(rows: list[dict]) -> set[tuple[str, str]]:
        return set().union(*(facts(r) for r in rows))

    assert not all_facts(fact["fact-train"]) & all_facts(fact["fact-test"])
    assert all_facts(questions["train"]) & all_facts(questions["test"])  # the id split shares facts
    ids = sorted(r["id"] for rows in fact.values() for r in rows)
    assert ids == sorted(r["id"] for split in SPLITS for r in questions[split])
    for split, rows in fact.items():
        assert all(factbook.fact_split_of(r["id"].split("-")[0]) == split for r in rows)
    hops = Counter(r["metadata"]["hops"] for r in fact["fact-test"])
    assert sum(hops.values()) >= 500 and hops[1] >= 250 and hops[2] >= 150, hops
    assert built[0].num_fact_test == len(fact["fact-test"])


def test_seed_changes_phrasing_not_splits(tmp_path, few_entries):
    a = build_factbook(tmp_path / "a", seed=0, progress=False)
    b = build_factbook(tmp_path / "b", seed=1, progress=False)
    assert a.corpus.read_bytes() == b.corpus.read_bytes()
    for split in SPLITS:
        rows_a, rows_b = read_jsonl(getattr(a, split)), read_jsonl(getattr(b, split))
        assert [r["id"] for r in rows_a] == [r["id"] for r in rows_b]
    questions_a = {r["question"] for s in SPLITS for r in read_jsonl(getattr(a, s))}
    questions_b = {r["question"] for s in SPLITS for r in read_jsonl(getattr(b, s))}
    assert questions_a != questions_b


def test_failed_build_leaves_nothing_behind(tmp_path, few_entries, monkeypatch):
    write = factbook.write_jsonl

    def crash_on_test_split(path, rows, **kwargs):
        if path.name == "test.jsonl":
            raise OSError("disk full")
        write(path, rows, **kwargs)

    monkeypatch.setattr(factbook, "write_jsonl", crash_on_test_split)
    with pytest.raises(OSError, match="disk full"):
        build_factbook(tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []  # no out dir, no temp dir

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "corpus.jsonl").write_text("old\n")
    with pytest.raises(OSError, match="disk full"):
        build_factbook(tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "corpus.jsonl").read_text() == "old\n"  # untouched
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_rebuild_into_existing_dir(tmp_path, few_entries):
    first = build_factbook(tmp_path / "out", progress=False)
    before = first.train.read_bytes()
    second = build_factbook(tmp_path / "out", progress=False)
    assert second.train.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "corpus.jsonl",
        "dev.jsonl",
        "fact-test.jsonl",
        "fact-train.jsonl",
        "test.jsonl",
        "train.jsonl",
    ]


# ------------------------------------------------------------------------------------------- loaders

GOOD_ROWS = [
    {
        "id": "q1",
        "question": "What is the capital of Peru?",
        "golden_answers": ["Lima"],
        "metadata": {"hops": 1},
    },
    {"id": "q2", "question": "Capital of Chile?", "golden_answers": ["Santiago", "Santiago de Chile"]},
    {"id": 3, "question": "Currency of Peru?", "golden_answers": "nuevo sol"},  # int id, bare string answer
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8"
    )
    return path


def test_load_qa_jsonl(tmp_path):
    examples = load_qa(write_jsonl(tmp_path / "train.jsonl", GOOD_ROWS))
    assert examples[0] == QAExample("q1", "What is the capital of Peru?", ("Lima",), {"hops": 1})
    assert examples[1].golden_answers == ("Santiago", "Santiago de Chile")
    assert examples[1].metadata == {}
    assert examples[2].id == "3" and examples[2].golden_answers == ("nuevo sol",)
    assert len(load_qa(tmp_path / "train.jsonl", limit=2)) == 2
    assert load_qa(str(tmp_path), split="train") == examples  # a folder plus a split name
    hash(examples[0])  # usable in sets despite the metadata dict


def test_load_qa_parquet_round_trip(tmp_path):
    pd = pytest.importorskip("pandas")
    rows = [
        {
            "id": "q1",
            "question": "Q one?",
            "golden_answers": ["a", "b"],
            "metadata": {"kind": "capital", "hops": 1},
        },
        {
            "id": "q2",
            "question": "Q two?",
            "golden_answers": ["c"],
            "metadata": {"kind": "currency", "hops": 2},
        },
    ]
    pd.DataFrame(rows).to_parquet(tmp_path / "dev.parquet")
    from_parquet = load_qa(tmp_path / "dev.parquet")
    assert from_parquet == load_qa(write_jsonl(tmp_path / "dev.jsonl", rows))
    assert from_parquet[1].metadata == {"kind": "currency", "hops": 2}
    assert from_parquet[0].golden_answers == ("a", "b")


def test_load_qa_reads_the_built_splits(built, questions):
    examples = load_qa(built[0].dev)
    assert [e.id for e in examples] == [row["id"] for row in questions["dev"]]
    assert all(isinstance(e.metadata["passage_ids"], list) for e in examples)


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        (
            '{"id": "x", "golden_answers": ["a"]}',
            "line 3: field 'question' must be a non-empty string (got missing)",
        ),
        (
            '{"id": "x", "question": "q?", "golden_answers": 5}',
            "line 3: field 'golden_answers' must be a non-empty list of strings (got int)",
        ),
        (
            '{"id": "x", "question": "q?", "golden_answers": []}',
            "line 3: field 'golden_answers' must be a non-empty list of strings (got empty list)",
        ),
        (
            '{"id": "x", "question": "q?", "golden_answers": ["a", 1]}',
            "line 3: field 'golden_answers' must be a non-empty list of strings (got an item of type int)",
        ),
        (
            '{"question": "q?", "golden_answers": ["a"]}',
            "line 3: field 'id' must be a non-empty string or an integer (got missing)",
        ),
        (
            '{"id": "x", "question": "  ", "golden_answers": ["a"]}',
            "line 3: field 'question' must be a non-empty string (got empty str)",
        ),
        (
            '{"id": "x", "question": "q?", "golden_answers": ["a"], "metadata": [1]}',
            "line 3: field 'metadata' must be an object (got list)",
        ),
        ('{"id": "x", "question": "q?", "golden_answers": ["a"]', "line 3: invalid JSON"),
        ('["x", "q?"]', "line 3: each row must be a JSON object (got list)"),
    ],
)
def test_load_qa_bad_rows_name_file_line_and_field(tmp_path, bad_line, message):
    path = write_jsonl(tmp_path / "train.jsonl", [GOOD_ROWS[0], "", bad_line])  # a blank line still counts
    with pytest.raises(DataError) as error:
        load_qa(path)
    assert str(error.value).startswith(f"{path} {message}")


def test_load_qa_missing_file(tmp_path):
    with pytest.raises(DataError, match=re.escape(str(tmp_path / "nope.jsonl"))):
        load_qa(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="no test.jsonl or test.parquet"):
        load_qa(tmp_path, split="test")
    with pytest.raises(DataError, match="split="):
        load_qa(tmp_path)


def test_load_qa_from_the_hub_goes_through_datasets(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load_dataset(source, split=None):
        calls.append((source, split))
        return datasets.Dataset.from_list(GOOD_ROWS[:2])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    examples = load_qa("someone/some-qa", split="test", limit=1)
    assert calls == [("someone/some-qa", "test")]
    assert [e.id for e in examples] == ["q1"]


def test_load_corpus(tmp_path, built, corpus):
    docs = load_corpus(built[0].corpus)
    assert len(docs) == len(corpus)
    doc = next(d for d in docs if d.id == "pe-government-1")
    assert doc.title == "Peru - Government"
    assert doc.text.startswith("Peru - Government - Capital: name: Lima;")
    assert doc.contents == corpus["pe-government-1"]

    bad = write_jsonl(
        tmp_path / "corpus.jsonl", [{"id": "a", "contents": "T\ntext"}, {"id": "b", "text": "x"}]
    )
    with pytest.raises(DataError, match=r"corpus\.jsonl line 2: field 'contents' must be a non-empty string"):
        load_corpus(bad)
    with pytest.raises(DataError, match="no such file"):
        load_corpus(tmp_path / "missing.jsonl")


def test_stratified_sample_is_seeded_and_keeps_the_hop_shares():
    """``limit`` with ``sample=stratified``: a seeded random draw that keeps each hop's share, never the
    first N rows; rows without hops (other datasets) are drawn at random."""
    from eval.config import HarnessConfig, Sample
    from eval.run import load_datasets
    from zerosim.core.data.qa import sample_examples

    rows = [
        QAExample(f"q{i:03d}", f"question {i}?", ("a",), {"hops": 1 if i < 60 else 2}) for i in range(100)
    ]
    first = sample_examples(rows, 20, seed=0)
    assert [r.id for r in first] == [r.id for r in sample_examples(rows, 20, seed=0)]  # seeded
    assert [r.id for r in first] != [r.id for r in sample_examples(rows, 20, seed=1)]
    assert [r.id for r in first] != [r.id for r in rows[:20]]
    assert Counter(r.metadata["hops"] for r in first) == {1: 12, 2: 8}  # 60/40 kept
    assert [r.id for r in first] == sorted(r.id for r in first)  # in file order
    plain = [QAExample(f"p{i}", f"p {i}?", ("a",)) for i in range(10)]
    assert len({r.id for r in sample_examples(plain, 4, seed=0)}) == 4
    assert sample_examples(plain, 50, seed=0) == plain

    def held_out(**sampling):
        ((_, rows),) = load_datasets(HarnessConfig(datasets=["factbook:fact-test"], limit=40, **sampling))
        return rows

    sample = held_out(sample=Sample.stratified)
    assert len(sample) == 40 and [r.id for r in sample] != [r.id for r in held_out()]
    from zerosim.core.data.embedded import ensure_factbook

    everything = load_qa(ensure_factbook().fact_test)
    share = Counter(r.metadata["hops"] for r in everything)[2] / len(everything)
    assert abs(Counter(r.metadata["hops"] for r in sample)[2] / 40 - share) <= 1 / 40


def test_fact_dev_and_fact_tune_split_fact_train_by_country():
    """The recipe sweep's dev set: fact-train's questions on ~12% of its countries; fact-tune the rest. No country
    is shared by fact-tune, fact-dev and fact-test, and the two together are fact-train."""
    from zerosim.core.data.embedded import load_questions

    dev, tune = load_questions("factbook", "fact-dev"), load_questions("factbook", "fact-tune")
    train, test = load_questions("factbook", "fact-train"), load_questions("factbook", "fact-test")

    def countries(rows):
        return {row.id.split("-")[0] for row in rows}

    assert sorted(r.id for r in dev + tune) == sorted(r.id for r in train)
    assert not countries(dev) & countries(tune) and not countries(dev) & countries(test)
    assert 150 <= len(dev) <= 260
    assert [r.id for r in load_questions("factbook", "fact-dev", limit=5)] == [r.id for r in dev[:5]]
