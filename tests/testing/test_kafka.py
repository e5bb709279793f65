"""The Kafka fixture's cluster id: drawn again when it would start with ``-`` (the CI run of
2026-11-29 failed when one did: the storage tool read the id as an option)."""

from __future__ import annotations

import base64
import uuid

from spark_stretch.testing import kafka


def test_a_cluster_id_never_starts_with_a_dash(monkeypatch):
    # 0xF8 as the first byte makes the first base64url character '-' (index 62).
    draws = iter([uuid.UUID(bytes=b"\xf8" + bytes(15)), uuid.UUID(bytes=b"\x10" * 16)])
    monkeypatch.setattr(kafka.uuid, "uuid4", lambda: next(draws))
    cid = kafka.cluster_id()
    assert cid == "EBAQEBAQEBAQEBAQEBAQEA"
    assert next(draws, None) is None  # the dashed id was drawn and thrown away


def test_a_cluster_id_is_a_uuid_in_url_safe_base64():
    for _ in range(2000):
        cid = kafka.cluster_id()
        assert not cid.startswith("-") and len(cid) == 22
        assert len(base64.urlsafe_b64decode(cid + "==")) == 16
