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
        # The Loader's own arithmetic (len(), the torch wrapper's constructor) divides by these:
        # a ZeroDivisionError named neither.
        ({"batch_size": 0}, "batch_size must be an integer from 1 to 1048576, not 0"),
        # The daemon's limit, refused when the Loader is made rather than at its first batch.
        ({"batch_size": 2_000_000}, "batch_size must be an integer from 1 to 1048576, not 2000000"),
        ({"world_size": 0, "rank": 0}, "world_size must be an integer from 1 to 1048576, not 0"),
        # The plan's limit: refused at the first batch before.
        ({"world_size": 1 << 31, "rank": 0}, "world_size must be an integer from 1 to 1048576, not 2147483648"),
        ({"world_size": 2, "rank": 2}, "rank 2 .*world_size 2"),
        # bool() made any non-empty string true: shuffle="False" shuffled, drop_last="no" dropped.
        ({"shuffle": "False"}, "shuffle must be True or False"),
        ({"drop_last": "no"}, "drop_last must be True or False"),
        ({"copy": 1}, "copy must be True or False"),
        ({"binary_views": None}, "binary_views must be True or False"),
    ],
)
def test_bad_arguments_fail_before_connecting(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        shardstream.Loader("/nonexistent", connect="unix:///nonexistent/sock", **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"transport": "shm"}, 'transport "shm" needs .* tcp://127.0.0.1:1 is a TCP address'),
        ({"binary_views": True}, "binary_views needs the shared-memory transport .* tcp://127.0.0.1:1 is a TCP"),
    ],
)
def test_what_no_stream_over_tcp_can_do_is_refused_before_connecting(kwargs, match) -> None:
    """Accepted (len() answered) and refused at the first batch, in a DataLoader worker."""
    with pytest.raises(ValueError, match=match):
        shardstream.Loader("/nonexistent", connect="tcp://127.0.0.1:1", **kwargs)


def test_a_tls_ca_file_that_holds_no_certificate_is_named(monkeypatch, tmp_path) -> None:
    # A token or key given as the CA: every handshake then failed as "UnknownIssuer", a
    # ConnectionError naming no file.
    wrong = tmp_path / "token"
    wrong.write_text("0123456789abcdef0123456789abcdef\n")
    monkeypatch.setenv("SHARDSTREAM_TLS_CA", str(wrong))
    monkeypatch.setenv("SHARDSTREAM_TOKEN_FILE", str(wrong))
    with pytest.raises(ValueError, match=f"{wrong} \\(SHARDSTREAM_TLS_CA\\) holds no PEM certificate"):
        shardstream.Loader("/nonexistent", connect="tls://127.0.0.1:1")


@pytest.mark.parametrize("url", [None, 123, 1.5, ["/data"]])
def test_a_url_that_is_no_path_is_a_type_error(url) -> None:
    # str() made a path of anything: Loader(None) looked for "./None" and said it was not found.
    with pytest.raises(TypeError, match=f"url must be a path or URL .* not {type(url).__name__}"):
        shardstream.Loader(url, connect="unix:///nonexistent/sock")


@pytest.mark.parametrize("urls", [["/data/a-000000.tar", "/data/a-000001.tar"], ("s3://b/x.parquet",)])
def test_a_list_of_shards_as_webdataset_takes_it_says_how_to_name_them(urls) -> None:
    # `wds.WebDataset([...])` takes a list of shard URLs; a ported pipeline passing one was told
    # only "not list".
    with pytest.raises(TypeError, match=r"not (list|tuple): .*one dataset.*brace pattern.*\{000000\.\.000099\}"):
        shardstream.Loader(urls, connect="unix:///nonexistent/sock")


def test_a_bytes_or_pathlike_url_is_a_path_and_an_empty_one_is_refused(tmp_path) -> None:
    import pathlib

    from shardstream import _dataset_url

    assert _dataset_url(b"/data/train/") == "/data/train/"
    assert _dataset_url(pathlib.Path("/data/x")) == "/data/x"
    assert _dataset_url(b"rel") == str(pathlib.Path.cwd() / "rel")
    with pytest.raises(ValueError, match="url is empty"):
        shardstream.Loader("", connect="unix:///nonexistent/sock")


@pytest.mark.parametrize(("var", "value"), [("WORLD_SIZE", "abc"), ("RANK", "1.5"), ("WORLD_SIZE", "0")])
def test_a_bad_rank_or_world_size_in_the_environment_is_named(monkeypatch, var: str, value: str) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=f"{var}={value!r}"):
        shardstream.Loader("/nonexistent", connect="unix:///nonexistent/sock")


@pytest.mark.parametrize("value", ["0", "2.5", "soon", "3601"])
def test_a_bad_tcp_timeout_in_the_environment_is_named(monkeypatch, value: str) -> None:
    monkeypatch.setenv("SHARDSTREAM_TCP_TIMEOUT", value)
    with pytest.raises(ValueError, match=f'SHARDSTREAM_TCP_TIMEOUT must be .* not "{value}"'):
        shardstream.Loader("/nonexistent", connect="tcp://127.0.0.1:1")


def test_explicit_address_is_used_as_given(monkeypatch) -> None:
    monkeypatch.setenv("SHARDSTREAM_ADDR", "unix:///elsewhere")
    assert shardstream.resolve_address("tcp://127.0.0.1:1") == "tcp://127.0.0.1:1"
    assert shardstream.resolve_address("auto") == "unix:///elsewhere"


def test_exceptions_are_exported() -> None:
    assert issubclass(shardstream.ShardError, shardstream.ShardstreamError)
    assert issubclass(shardstream.ShardstreamError, Exception)
    assert shardstream.__version__


def test_the_package_exceptions_pickle_as_themselves() -> None:
    # torch carries a DataLoader worker's exception to the trainer by pickling its type: with
    # the module '_native' that failed, and the worker's error was lost.
    import pickle

    for cls in (shardstream.ShardError, shardstream.ShardstreamError):
        e = pickle.loads(pickle.dumps(cls("shard x.tar: bad")))
        assert type(e) is cls and str(e) == "shard x.tar: bad"
        assert pickle.loads(pickle.dumps(cls)) is cls


def test_a_rust_panic_is_an_ordinary_exception() -> None:
    # PyO3 would raise PanicException, a BaseException that `except Exception` misses.
    try:
        shardstream._native._panic_for_tests()
    except Exception as e:  # noqa: BLE001 - the point: an ordinary Exception
        assert isinstance(e, shardstream.ShardstreamError), repr(e)
        assert "deliberate panic" in str(e) and "bug" in str(e)
    else:
        raise AssertionError("no exception")


def test_a_world_size_without_a_rank_in_the_environment_is_refused(monkeypatch) -> None:
    # A launcher that sets WORLD_SIZE but not RANK (srun with WORLD_SIZE exported) gave every
    # process rank 0: each read the same share, the rest of the data never, and nothing said.
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="world_size is 4 but no rank is given"):
        shardstream.Loader("/nonexistent", connect="unix:///nonexistent/sock")
    # The world size given as an argument, without a rank: the same.
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ValueError, match="world_size is 4 but no rank is given"):
        shardstream.Loader("/nonexistent", world_size=4, connect="unix:///nonexistent/sock")
    # An explicit rank, or a world of one (from the environment or the argument), needs no RANK.
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConnectionError):
        shardstream.Loader("/nonexistent", rank=1, connect="unix:///nonexistent/sock")
    with pytest.raises(ConnectionError):
        shardstream.Loader("/nonexistent", world_size=1, connect="unix:///nonexistent/sock")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConnectionError):
        shardstream.Loader("/nonexistent", connect="unix:///nonexistent/sock")
