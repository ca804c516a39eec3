"""What a client presents is checked before any RPC (issue 39): a token read with its newline
works, a token gRPC cannot carry is refused naming the setting, and TLS files that are not what
their setting names are refused naming the setting and the path (gRPC would only fail at the
first connection, in words about a handshake that sent users to `make serve`).

Real files (a throw-away PKI made with openssl), no daemon: each refusal comes before a channel.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from redis_cluster import make_test_pki

import kvtier
from kvtier.credentials import bearer_metadata, tls_credentials
from kvtier_contract import errors

SECRET = "tok-a-39-secret"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    make_test_pki(d)
    make_test_pki(d / "other")
    return d


@pytest.mark.parametrize(
    "written", [f"{SECRET}\n", f"{SECRET}\r\n", f"  {SECRET} \n", f"{SECRET}\nsecond line\n"]
)
def test_a_token_file_with_its_newline_gives_the_bare_token(tmp_path: Path, written: str) -> None:
    f = tmp_path / "token"
    f.write_text(written)
    assert bearer_metadata(None, str(f)) == (("authorization", f"Bearer {SECRET}"),)


def test_a_token_given_with_its_newline_gives_the_bare_token() -> None:
    # (what `token=open(path).read()` or `token=os.environ["TOKEN"]` with a newline passes)
    assert bearer_metadata(f"{SECRET}\n", None) == (("authorization", f"Bearer {SECRET}"),)


@pytest.mark.parametrize("bad, what", [("tok\x07en", "control character U+0007"), ("tök", "non-ASCII")])
def test_a_token_grpc_cannot_carry_is_refused_naming_the_setting(tmp_path: Path, bad: str, what: str) -> None:
    with pytest.raises(errors.InvalidArgument) as e:
        bearer_metadata(bad, None)
    assert e.value.field == "token" and what in str(e.value) and bad not in str(e.value)
    f = tmp_path / "token"
    f.write_text(bad + "\n")
    with pytest.raises(errors.InvalidArgument) as e:
        bearer_metadata(None, str(f))
    assert e.value.field == "token_file" and what in str(e.value)
    # Refused when the client is made: no RPC, no "Internal: Invalid metadata" at the first call.
    with pytest.raises(errors.InvalidArgument, match="token_file: "):
        kvtier.Client(f"unix://{tmp_path}/none.sock", "tcp", token_file=str(f))


def test_a_tls_ca_that_is_not_a_certificate_is_named(tmp_path: Path, pki: Path) -> None:
    for text in ("hello\n", "", (pki / "ca.key").read_text()):
        bad = tmp_path / "ca.pem"
        bad.write_text(text)
        with pytest.raises(errors.InvalidArgument) as e:
            tls_credentials(str(bad), None, None)
        assert e.value.field == "tls_ca", e.value
        assert f"{bad} is not a PEM certificate" in str(e.value)
    with pytest.raises(errors.InvalidArgument, match=r"tls_ca: .* is not a PEM certificate"):
        kvtier.Client.connect("127.0.0.1:1", "tcp", tls_ca=str(bad))  # before any connection
    assert tls_credentials(str(pki / "ca.crt"), None, None) is not None


def test_a_client_certificate_or_key_that_is_not_one_is_named(tmp_path: Path, pki: Path) -> None:
    ca, cert, key = str(pki / "ca.crt"), str(pki / "client.crt"), str(pki / "client.key")
    junk = tmp_path / "junk.pem"
    junk.write_text("not pem\n")
    with pytest.raises(errors.InvalidArgument) as e:
        tls_credentials(ca, str(junk), key)
    assert e.value.field == "tls_cert" and f"{junk} is not a PEM certificate" in str(e.value)
    with pytest.raises(errors.InvalidArgument) as e:
        tls_credentials(ca, cert, str(junk))
    assert e.value.field == "tls_key" and f"{junk} is not a PEM private key" in str(e.value)
    with pytest.raises(errors.InvalidArgument) as e:
        tls_credentials(ca, cert, str(pki / "other" / "client.key"))
    assert e.value.field == "tls_key" and f"is not the key of tls_cert {cert}" in str(e.value)
    assert tls_credentials(ca, cert, key) is not None
