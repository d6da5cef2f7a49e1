"""A small OAuth 2 server for the OAUTHBEARER tests, run as a subprocess on
127.0.0.1: GET /jwks serves the JWKS file (re-read each time, so a test
rotates keys by rewriting it), POST /token grants client credentials
(RFC 6749 section 4.4, HTTP Basic) with a JWT signed by the key given,
GET /stats counts the requests, POST /down and /up make /token fail or
work. https when --cert and --key are given. ``OAuthServer`` below starts one with a key
of its own (RS256) for a Kafka node's OAUTHBEARER listener.

    python kthrottle_testkit/oauth_server.py --port P --jwks FILE [--signing-key PEM --kid K
        --client-id ID --client-secret S --audience A --issuer I --lifetime S]
        [--cert PEM --key PEM]
"""
import argparse
import base64
import json
import ssl
import subprocess
import sys
import time
from pathlib import Path

import jwt
from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from kthrottle.embedded import free_port, stop_process, wait_for_port

SCRIPT = Path(__file__).resolve()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--jwks", required=True)
    parser.add_argument("--signing-key")
    parser.add_argument("--kid", default="k1")
    parser.add_argument("--client-id", default="proxy")
    parser.add_argument("--client-secret", default="proxy-secret")
    parser.add_argument("--audience", default="kafka")
    parser.add_argument("--issuer", default="https://issuer.test")
    parser.add_argument("--lifetime", type=float, default=60.0)
    parser.add_argument("--cert")
    parser.add_argument("--key")
    args = parser.parse_args()
    stats = {"jwks": 0, "token": 0, "refused": 0}
    state = {"down": False}

    async def jwks(request):
        stats["jwks"] += 1
        with open(args.jwks, "rb") as f:
            return web.Response(body=f.read(), content_type="application/json")

    async def token(request):
        stats["token"] += 1
        if state["down"]:
            return web.Response(status=503, text="down")
        header = request.headers.get("Authorization", "")
        expected = "Basic " + base64.b64encode(
            ("%s:%s" % (args.client_id, args.client_secret)).encode()).decode()
        form = await request.post()
        if header != expected or form.get("grant_type") != "client_credentials":
            stats["refused"] += 1
            return web.json_response({"error": "invalid_client"}, status=401)
        with open(args.signing_key, "rb") as f:
            key = f.read()
        now = int(time.time())
        claims = {"sub": args.client_id, "aud": args.audience, "iss": args.issuer, "iat": now,
                  "exp": now + int(args.lifetime)}
        if form.get("scope"):
            claims["scope"] = form["scope"]
        access = jwt.encode(claims, key, algorithm="RS256", headers={"kid": args.kid})
        return web.json_response({"access_token": access, "token_type": "bearer",
                                  "expires_in": int(args.lifetime)})

    async def get_stats(request):
        return web.json_response(stats)

    async def down(request):
        state["down"] = True
        return web.Response(text="down")

    async def up(request):
        state["down"] = False
        return web.Response(text="up")

    app = web.Application()
    app.add_routes([web.get("/jwks", jwks), web.post("/token", token),
                    web.get("/stats", get_stats), web.post("/down", down),
                    web.post("/up", up)])
    context = None
    if args.cert:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(args.cert, args.key)
    web.run_app(app, host="127.0.0.1", port=args.port, ssl_context=context, print=None)


class OAuthServer:
    """This server on 127.0.0.1 as a subprocess, stopped by its PID: a JWKS and
    client-credentials tokens (RS256) of a key made here, files in ``tmp``."""

    CLIENT_ID, CLIENT_SECRET = "kafka-client", "kafka-client-secret"
    AUDIENCE, ISSUER = "kafka", "https://issuer.test"

    def __init__(self, tmp):
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
        jwk.update(kid="k1", use="sig", alg="RS256")
        (tmp / "jwks.json").write_text(json.dumps({"keys": [jwk]}))
        (tmp / "signing.pem").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        self.port = free_port()
        self.args = [sys.executable, str(SCRIPT),
                     "--port", str(self.port), "--jwks", str(tmp / "jwks.json"),
                     "--signing-key", str(tmp / "signing.pem"), "--kid", "k1",
                     "--client-id", self.CLIENT_ID, "--client-secret", self.CLIENT_SECRET,
                     "--audience", self.AUDIENCE, "--issuer", self.ISSUER, "--lifetime", "600"]
        self.log = tmp / "oauth.log"
        self.proc = None

    def url(self, path):
        return "http://127.0.0.1:%d%s" % (self.port, path)

    def start(self):
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        wait_for_port("127.0.0.1", self.port, proc=self.proc)
        return self

    def stop(self):
        stop_process(self.proc, grace=10)


if __name__ == "__main__":
    main()
