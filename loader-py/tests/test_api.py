"""The Python layer's own checks, without a daemon: arguments are refused before any connection."""

from __future__ import annotations

import pytest

import shardstream


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"transport": "udp"}, "transport"),
        ({"fields": "jpg"}, "list of field names"),
        ({"batch_size": -1}, "batch_size"),
        ({"batch_size": 1.5}, "batch_size"),
        ({"seed": 1 << 64}, "seed"),
        ({"rank": True}, "rank"),
    ],
)
def test_bad_arguments_fail_before_connecting(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        shardstream.Loader("/nonexistent", connect="unix:///nonexistent/sock", **kwargs)


def test_explicit_address_is_used_as_given(monkeypatch) -> None:
    monkeypatch.setenv("SHARDSTREAM_ADDR", "unix:///elsewhere")
    assert shardstream.resolve_address("tcp://127.0.0.1:1") == "tcp://127.0.0.1:1"
    assert shardstream.resolve_address("auto") == "unix:///elsewhere"


def test_exceptions_are_exported() -> None:
    assert issubclass(shardstream.ShardError, shardstream.ShardstreamError)
    assert issubclass(shardstream.ShardstreamError, Exception)
    assert shardstream.__version__


def test_a_rust_panic_is_an_ordinary_exception() -> None:
    # PyO3 would raise PanicException, a BaseException that `except Exception` misses.
    try:
        shardstream._native._panic_for_tests()
    except Exception as e:  # noqa: BLE001 - the point: an ordinary Exception
        assert isinstance(e, shardstream.ShardstreamError), repr(e)
        assert "deliberate panic" in str(e) and "bug" in str(e)
    else:
        raise AssertionError("no exception")
