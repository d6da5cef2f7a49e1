"""Kafka's client quotas: byte rates (KIP-13, KIP-55) and request rates
(KIP-124), counted per <user, client-id> as the policy resolves them."""
from ...codecs import apis
from ...codecs.request import capped_fetch_head
from ...policy.quotas import client_quotas_apply
from ..filter import HEAD, NOTHING, Filter, Forward, Throttle


class QuotaAccounting(Filter):
    """KIP-55 byte-rate and KIP-124 request-rate quotas: every request is
    counted (the policy says which are exempt), a Fetch response counts its
    size, and what a client earns comes back as a Throttle."""

    name = "quotas"

    @classmethod
    def build(cls, config, services):
        return None if services.quotas is None else cls()

    def request_need(self, api_key, api_version):
        return HEAD

    def authenticating_need(self, api_key, api_version):
        # a broker answers the requests before authentication (ApiVersions,
        # SASL) in its authenticator, outside the quotas; and the principal
        # they would count against is not known yet
        return NOTHING

    def response_need(self, api_key, api_version):
        return HEAD if api_key == apis.FETCH else NOTHING

    def on_request(self, ctx, head, inflight):
        api_key = head.api_key
        if api_key == apis.PRODUCE:  # acks=0 too: its throttle mutes the client
            return _verdict(ctx.quotas_for(head.client_id or "").on_request(
                api_key, head.frame_len, head.acks, ctx.now))
        if api_key == apis.FETCH and not client_quotas_apply(api_key, head.replica_id):
            return None
        quotas = ctx.quotas_for(head.client_id or "")
        if api_key == apis.FETCH:  # its response counts too (on_response_head)
            ctx.note(inflight, quotas)
        return _verdict(quotas.on_request(api_key, head.frame_len, None, ctx.now))

    def quick(self, api_key, api_version):
        return api_key == apis.PRODUCE or api_key == apis.FETCH

    def quick_judge(self, ctx, head):
        # The policy's Decision has a Throttle's delay_ms and reason.
        if head.api_key == apis.PRODUCE:  # acks 1 or -1 (pass_request)
            return ctx.quotas_for(head.client_id).on_produce
        if not client_quotas_apply(apis.FETCH, head.replica_id):
            return None
        quotas = ctx.quotas_for(head.client_id)
        note = ctx.note
        on_request = quotas.on_request

        def judge(frame_len, now, inflight):
            note(inflight, quotas)  # its response counts too (quick_response_head)
            return on_request(apis.FETCH, frame_len, None, now)

        return judge

    def quick_lease(self, ctx, head):
        if head.api_key != apis.PRODUCE:
            return None
        return ctx.quotas_for(head.client_id).lease_produce

    def quick_response_head(self, ctx, inflight, frame_len):
        return self.on_response_head(ctx, inflight, None, frame_len)

    def on_response_head(self, ctx, inflight, head, frame_len):
        quotas = ctx.noted(inflight)
        if quotas is None:
            return None
        # The response is forwarded whole even when over quota: Kafka answers
        # an over-quota fetch empty, but a proxy that did so would drop
        # records the broker counted as sent to an incremental fetch session
        # (KIP-227). The client is made to wait instead, and its fetch size is
        # capped (FetchCap).
        return _verdict(quotas.on_fetch_response(frame_len, ctx.now))


def _verdict(decision):
    return Throttle(decision.delay_ms, decision.reason) if decision.delay_ms else None


class FetchCap(Filter):
    """A consumer's fetch is capped at what its quota allows at once (Kafka:
    quota x window), so one response cannot carry minutes of quota."""

    name = "fetch-cap"

    @classmethod
    def build(cls, config, services):
        return None if services.quotas is None else cls()

    def request_need(self, api_key, api_version):
        return HEAD if api_key == apis.FETCH and api_version >= 3 else NOTHING

    def authenticating_need(self, api_key, api_version):
        return NOTHING  # no Fetch gets through before authentication

    def quick(self, api_key, api_version):
        return api_key == apis.FETCH

    def quick_check(self, ctx, head):
        # the short way for a fetch that asks for no more than the cap
        if not client_quotas_apply(apis.FETCH, head.replica_id) or head.max_bytes is None:
            return None
        fetch_max_bytes = ctx.quotas_for(head.client_id).fetch_max_bytes
        max_bytes = head.max_bytes

        def check():
            cap = fetch_max_bytes()
            return cap is None or max_bytes <= max(int(cap), 1)

        return check

    def on_request(self, ctx, head, inflight):
        if not client_quotas_apply(head.api_key, head.replica_id):
            return None
        cap = ctx.quotas_for(head.client_id or "").fetch_max_bytes()
        if cap is None:
            return None
        patched = capped_fetch_head(head, max(int(cap), 1))
        return None if patched is None else Forward(patched)
