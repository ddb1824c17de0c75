"""``POST /v1/node/dataplane-certificate``: a node, with its own credential, gets a
certificate from the cluster CA for its own key and the host of the data-plane address
it reported, valid ``[tls] dataplane_cert_lifetime``; the operator, a node without an
address or an untrusted node get none, and bad keys are refused naming the field."""

from __future__ import annotations

import datetime as dt
import ipaddress

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from ctrl_helpers import bearer, enroll_node, error, result, update_node

from kibotos.ctrl.live.context import CtrlContext
from kibotos.ctrl.store.db import Store
from kibotos.protocol.certificates import DataplaneCertificate

PATH = "/v1/node/dataplane-certificate"


def public_pem(key: ec.EllipticCurvePrivateKey) -> str:
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


async def test_a_node_gets_a_certificate_for_its_key_and_address(
        client: httpx.AsyncClient, operator: dict[str, str], store: Store,
        ctx: CtrlContext) -> None:
    node = bearer(await enroll_node(client, operator, "node-a"))
    await update_node(store, "node-a", dataplane_address="127.0.0.1:7500")
    key = ec.generate_private_key(ec.SECP256R1())
    before = dt.datetime.now(dt.UTC)
    got = DataplaneCertificate.model_validate(result(
        await client.post(PATH, headers=node, json={"public_key": public_pem(key)})))
    assert ctx.cluster_ca is not None
    assert got.ca == ctx.cluster_ca.cert_pem.decode()
    assert got.names == ["127.0.0.1"]
    cert = x509.load_pem_x509_certificate(got.certificate.encode())
    cert.verify_directly_issued_by(ctx.cluster_ca.cert)
    assert cert.public_key() == key.public_key()
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    lifetime = dt.timedelta(seconds=ctx.config.tls.dataplane_cert_lifetime)
    assert before + lifetime - dt.timedelta(minutes=1) <= cert.not_valid_after_utc
    assert cert.not_valid_after_utc <= dt.datetime.now(dt.UTC) + lifetime


async def test_who_and_what_is_refused(client: httpx.AsyncClient, operator: dict[str, str],
                                       store: Store) -> None:
    node = bearer(await enroll_node(client, operator, "node-a"))
    good = {"public_key": public_pem(ec.generate_private_key(ec.SECP256R1()))}
    error(await client.post(PATH, headers=operator, json=good), "permission_denied")
    error(await client.post(PATH, json=good), "unauthenticated")
    # No address reported yet, or one that names no host.
    assert "names no host" in error(await client.post(PATH, headers=node, json=good),
                                    "failed_precondition")["message"]
    await update_node(store, "node-a", dataplane_address="0.0.0.0:7500")
    error(await client.post(PATH, headers=node, json=good), "failed_precondition")
    await update_node(store, "node-a", dataplane_address="https://[::]:7500")
    error(await client.post(PATH, headers=node, json=good), "failed_precondition")
    await update_node(store, "node-a", dataplane_address="10.0.0.7:7500")
    other = ec.generate_private_key(ec.SECP384R1())
    for body, text in [
            ({"public_key": public_pem(other)}, "P-256"),
            ({"public_key": "not a key"}, "not a PEM public key"),
            ({**good, "surprise": 1}, "surprise"),
            ({"public_key": 1}, "public_key")]:
        assert text in error(await client.post(PATH, headers=node, json=body),
                             "invalid_argument")["message"], body
    await update_node(store, "node-a", admission="revoked")
    assert "isolated, retired or revoked" in error(
        await client.post(PATH, headers=node, json=good), "failed_precondition")["message"]


@pytest.mark.parametrize("value", ["30s", "91d", "soon"])
def test_the_lifetime_setting_is_bounded(value: str) -> None:
    from kibotos.config import CtrlConfig, parse
    from kibotos.core.errors import InvalidArgument
    with pytest.raises(InvalidArgument, match="dataplane_cert_lifetime"):
        parse(CtrlConfig, {"tls": {"dataplane_cert_lifetime": value}}, "ctrl.toml")


@pytest.mark.parametrize(("address", "name"), [("https://dp.example:7500", "dp.example"),
                                               ("https://[::1]:7500", "::1"),
                                               ("127.0.0.1:7500", "127.0.0.1")])
async def test_the_name_is_the_host_of_either_address_form(
        client: httpx.AsyncClient, operator: dict[str, str], store: Store, address: str,
        name: str) -> None:
    """A TLS data plane reports ``https://host:port``, a plain one ``host:port``."""
    node = bearer(await enroll_node(client, operator, "node-a"))
    await update_node(store, "node-a", dataplane_address=address)
    key = ec.generate_private_key(ec.SECP256R1())
    got = DataplaneCertificate.model_validate(result(
        await client.post(PATH, headers=node, json={"public_key": public_pem(key)})))
    assert got.names == [name]
