"""Namespace: deterministic salts and fingerprints; no donor crosses a namespace."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from semblend_sglang.config import Config
from semblend_sglang.lookup_params import LookupParams
from semblend_sglang.namespace import Namespace, namespace_salt, tokenizer_fingerprint
from semblend_sglang.provider import SemanticProvider

BASE = Namespace("SmolLM2-135M-Instruct", "fp", "lora-a", "extra", "salt")


def test_namespace_is_frozen_hashable_and_typed() -> None:
    assert hash(BASE) == hash(Namespace("SmolLM2-135M-Instruct", "fp", "lora-a", "extra", "salt"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        BASE.model = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        Namespace("m", adapter=3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "field", ["model", "tokenizer_fingerprint", "adapter", "extra_key", "cache_salt"]
)
def test_every_field_changes_the_salt(field: str) -> None:
    other = dataclasses.replace(BASE, **{field: "different"})
    assert namespace_salt(other) != namespace_salt(BASE)


def test_none_and_empty_differ() -> None:
    assert Namespace("m", cache_salt=None).salt != Namespace("m", cache_salt="").salt
    assert Namespace("m", adapter="ab").salt != Namespace("m", adapter="a", extra_key="b").salt


def test_salt_is_the_same_in_another_process_with_another_hash_seed() -> None:
    code = (
        "from semblend_sglang.namespace import Namespace;"
        "print(Namespace('SmolLM2-135M-Instruct','fp','lora-a','extra','salt').salt)"
    )
    env = dict(os.environ, PYTHONHASHSEED="987")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert int(out.stdout.strip()) == BASE.salt


def test_tokenizer_fingerprint_is_deterministic_and_content_sensitive(
    smollm2_tokenizer: Any,
) -> None:
    first = tokenizer_fingerprint(smollm2_tokenizer)
    assert first == tokenizer_fingerprint(smollm2_tokenizer)
    assert len(first) == 32

    class Edited:
        """The real tokenizer with one vocabulary entry renamed."""

        all_special_tokens = smollm2_tokenizer.all_special_tokens
        all_special_ids = smollm2_tokenizer.all_special_ids

        def get_vocab(self) -> dict[str, int]:
            vocab = dict(smollm2_tokenizer.get_vocab())
            token, idx = sorted(vocab.items())[100]
            del vocab[token]
            vocab[token + "x"] = idx
            return vocab

    assert tokenizer_fingerprint(Edited()) != first


def test_no_donor_is_returned_across_namespaces(
    smollm2_tokenizer: Any, essay_texts: list[str]
) -> None:
    tokens = np.asarray(
        smollm2_tokenizer(essay_texts[3], add_special_tokens=False)["input_ids"][:2000]
    )
    query = np.concatenate([tokens[-50:], tokens])
    config = Config(min_prompt_tokens=64)
    provider = SemanticProvider(config, registry=CollectorRegistry())
    provider.register(BASE, "donor", tokens)
    hit = provider.lookup(LookupParams(BASE, query, 0, "same"))
    assert hit.kind == "plan"
    assert hit.plan is not None and hit.plan.donor_namespace == BASE
    for i, field in enumerate(dataclasses.fields(Namespace)):
        for value in ("different", None if field.name != "model" else "m2"):
            other = dataclasses.replace(BASE, **{field.name: value})
            decision = provider.lookup(LookupParams(other, query, 0, f"other-{i}-{value}"))
            assert decision.kind == "decline", field.name
            assert decision.reason == "no_donor"
    # the same content registered in the other namespace is found there, and only there
    other = dataclasses.replace(BASE, adapter="lora-b")
    provider.register(other, "donor-b", tokens)
    decision = provider.lookup(LookupParams(other, query, 0, "b"))
    assert decision.plan is not None and decision.plan.donor_handle == "donor-b"
