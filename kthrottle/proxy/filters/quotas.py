"""Kafka's client quotas: byte rates (KIP-13, KIP-55) and request rates
(KIP-124), counted per <user, client-id> as the policy resolves them."""
from ...codecs import apis
from ...codecs.quota_answers import empty_fetch_response, produce_timed_out_response
from ...codecs.request import capped_fetch_head, capped_fetch_partitions, with_int32
from ...codecs.wire import INT32
from ...policy.entities import CONSUMER_BYTE_RATE
from ...policy.quotas import Decision, client_quotas_apply
from ...policy.rate import to_ms
from ..filter import (BUILT_WITH_QUOTAS, GATHER, GATHER_WHOLE, HEAD, NOTHING, Answer, Defer,
                      Forward, QuickFilter, Throttle)


# The longest a request is held while its bucket is in debt before it is
# answered in the broker's place: within the 30 s request.timeout.ms of the
# Java client and librdkafka, counting a mute of up to the default 10 s
# throttle cap that may come before it.
HOLD_SECONDS = 15.0


class _Waiting:
    """A connection's request held for its bucket's debt: since when."""

    __slots__ = ("since",)

    def __init__(self):
        self.since = None


class QuotaAccounting(QuickFilter):
    """KIP-55 byte-rate and KIP-124 request-rate quotas: every request is
    counted (the policy says which are exempt), a Fetch or ShareFetch
    response counts its size, and what a client earns comes back as a
    Throttle.

    The bucket owes the time, not the connection: while a bucket is in debt,
    a request counted in it waits unread (Defer), on whichever connection it
    comes, until the debt is paid, so that neither more connections nor
    more requests in flight take more than the quota. A request held
    HOLD_SECONDS is answered in the broker's place rather than left to time
    out: a Fetch as Kafka answers one over its quota (empty, throttled), a
    Produce REQUEST_TIMED_OUT (not written: the client retries)."""

    name = "quotas"
    built = BUILT_WITH_QUOTAS

    def new_state(self):
        return _Waiting()

    def request_need(self, api_key, api_version):
        return HEAD

    def authenticating_need(self, api_key, api_version):
        # a broker answers the requests before authentication (ApiVersions,
        # SASL) in its authenticator, outside the quotas; and the principal
        # they would count against is not known yet
        return NOTHING

    def response_need(self, api_key, api_version):
        return HEAD if api_key == apis.FETCH or api_key == apis.SHARE_FETCH else NOTHING

    def on_request(self, ctx, head, inflight):
        api_key = head.api_key
        if api_key == apis.FETCH and not client_quotas_apply(api_key, head.replica_id):
            return None
        quotas = ctx.quotas_for(head.client_id or "")
        acks = head.acks if api_key == apis.PRODUCE else None
        now = ctx.now
        owed = quotas.debt(api_key, acks, now)
        if owed is not None:
            verdict = self._owed(ctx, head, inflight, quotas, owed, acks)
            if verdict is not None:
                return verdict
        else:
            ctx.state.since = None
        if api_key != apis.FETCH and api_key != apis.SHARE_FETCH:
            # acks=0 too: its throttle mutes the client
            return _verdict(quotas.on_request(api_key, head.frame_len, acks, now))
        at = head.max_bytes_offset if api_key == apis.FETCH else head.share_fetch_max_bytes_offset
        charged = quotas.admit_fetch(None if at is None else INT32.unpack_from(head.buf, at)[0],
                                     now)  # its grant, what it is charged (FetchCap caps it)
        if charged is None:  # its bucket holds less than the least grant: it waits as for a debt
            verdict = self._owed(ctx, head, inflight, quotas, Decision(
                quotas.fetch_grant_wait_ms(now), CONSUMER_BYTE_RATE), acks)
            if verdict is not None:
                return verdict
            charged = 0  # held as long as a client waits: counted
        ctx.note(inflight, (quotas, charged))  # its response counts too
        return _verdict(quotas.on_request(api_key, head.frame_len, None, now))

    def _owed(self, ctx, head, inflight, quotas, owed, acks):
        """A request whose bucket is in debt (``owed``, a Decision): held
        (Defer) while its client still waits for the answer; then answered
        in the broker's place, or (None) let through and counted."""
        waiting = ctx.state
        now = ctx.now
        since = waiting.since
        if since is None:
            since = waiting.since = now
        left = since + HOLD_SECONDS - now
        api_key = head.api_key
        if left > 0 or (api_key == apis.PRODUCE and acks == 0):  # acks=0: none waits
            self.deferred += 1
            wait = owed.delay_ms if left <= 0 else min(owed.delay_ms, to_ms(left))
            return Defer(max(1, wait), owed.reason)
        # held as long as a client waits: answered now, with the throttle
        throttle = min(owed.delay_ms, to_ms(HOLD_SECONDS))
        if api_key == apis.PRODUCE:
            if len(head.buf) < head.frame_len:
                return GATHER_WHOLE  # its answer names each partition
            waiting.since = None
            self.answered += 1
            return Answer(produce_timed_out_response(head.buf, head.api_version,
                                                     head.correlation_id, throttle), throttle)
        waiting.since = None
        if api_key == apis.FETCH and not head.fetch_session_id:
            self.answered += 1
            return Answer(empty_fetch_response(head.correlation_id, head.api_version, throttle),
                          throttle)
        if api_key == apis.FETCH or api_key == apis.SHARE_FETCH:
            # A Fetch in an incremental fetch session (KIP-227): an answer of
            # the proxy's own would leave the broker's session epoch behind
            # the client's. A ShareFetch: the records it brings are acquired
            # for this member (KIP-932), left locked until their lock times
            # out. Either goes on asking for one byte (a broker still sends
            # one batch, KIP-74), its response counting as any does.
            ctx.note(inflight, (quotas, 0))
            quotas.fetch_cap = 1
            return _capped(head, 1)
        return None  # counted, throttled as it comes

    def quick(self, api_key, api_version):
        return api_key == apis.PRODUCE or api_key == apis.FETCH

    def quick_judge(self, ctx, head):
        # The policy's Decision has a Throttle's delay_ms and reason; a
        # request whose bucket is in debt is left to the long way (Defer).
        if head.api_key != apis.PRODUCE and not client_quotas_apply(apis.FETCH,
                                                                    head.replica_id):
            return None
        quotas = ctx.quotas_for(head.client_id)
        debt = quotas.debt
        if head.api_key == apis.PRODUCE:  # acks 1 or -1 (pass_request)
            on_produce = quotas.on_produce

            def judge_produce(frame_len, now):
                owed = debt(apis.PRODUCE, 1, now)
                if owed is not None:
                    return Defer(owed.delay_ms, owed.reason)
                return on_produce(frame_len, now)

            return judge_produce
        note = ctx.note
        admit = quotas.admit_fetch
        on_request = quotas.on_request
        max_bytes = head.max_bytes  # (FetchCap's check: no more than the grant)

        def judge(frame_len, now, inflight):
            # as on_request: the same policy calls, a debt or a grant under
            # the least left to the long way (FetchCap's check sees to the grant)
            owed = debt(apis.FETCH, None, now)
            if owed is not None:
                return Defer(owed.delay_ms, owed.reason)
            charged = admit(max_bytes, now)
            if charged is None:
                return _GRANT_WAIT
            note(inflight, (quotas, charged))  # its response counts too (quick_response_head)
            return on_request(apis.FETCH, frame_len, None, now)

        return judge

    def quick_lease(self, ctx, head):
        if head.api_key != apis.PRODUCE:
            return None
        return ctx.quotas_for(head.client_id).lease_produce

    def quick_response_head(self, ctx, inflight, frame_len):
        return self.on_response_head(ctx, inflight, None, frame_len)

    def on_response_head(self, ctx, inflight, head, frame_len):
        noted = ctx.noted(inflight)
        if noted is None:
            return None
        quotas, charged = noted
        if inflight.api_key == apis.FETCH:  # (a ShareFetch's records are acquired: no)
            # a response larger than the bucket's burst is paid for before it
            # is delivered: answered empty, as Kafka answers a fetch over
            # its quota, until the bucket has paid for it (then sent when
            # fetched again)
            prepaid = quotas.prepay_fetch(frame_len, ctx.now, charged)
            if prepaid is not None:
                if not prepaid:
                    return None
                self.prepaid += 1
                return Answer(empty_fetch_response(inflight.correlation_id,
                                                   inflight.api_version, prepaid), prepaid)
        # Counted whole, and forwarded whole: the requests the bucket's debt
        # holds back pay for it (on_request).
        return _verdict(quotas.on_fetch_response(frame_len, ctx.now, charged))

    # counters for the status page and tests: requests held for a debt, and
    # answered in the broker's place after HOLD_SECONDS
    deferred = 0
    answered = 0
    prepaid = 0  # Fetch responses larger than the burst, answered empty until paid for


# the short way's answer to a Fetch whose bucket holds less than the least
# grant: the long way holds it (FetchCap's check lets no such fetch through)
_GRANT_WAIT = Defer(1, CONSUMER_BYTE_RATE)


def _verdict(decision):
    return Throttle(decision.delay_ms, decision.reason) if decision.delay_ms else None


class FetchCap(QuickFilter):
    """A consumer's fetch asks only for what its bucket may take: the grant
    QuotaAccounting gave it (part of what the bucket holds; Kafka's cap,
    quota x window, in window mode), so the fetches in flight cannot carry
    more than the quota allows at once; what an oversized first batch
    (KIP-74) overshoots is debt the next requests pay.
    Versions 0-2 have no request-wide max_bytes: each partition's max is
    capped instead."""

    name = "fetch-cap"
    built = BUILT_WITH_QUOTAS

    def request_need(self, api_key, api_version):
        if api_key == apis.SHARE_FETCH:
            return HEAD
        if api_key != apis.FETCH:
            return NOTHING
        return HEAD if api_version >= 3 else GATHER  # v0-2: the partitions' max

    def authenticating_need(self, api_key, api_version):
        return NOTHING  # no Fetch gets through before authentication

    def quick(self, api_key, api_version):
        return api_key == apis.FETCH

    def quick_check(self, ctx, head):
        # the short way for a fetch that asks for no more than its bucket
        # holds now (ctx.now is the time of the read being judged)
        if not client_quotas_apply(apis.FETCH, head.replica_id) or head.max_bytes is None:
            return None
        quotas = ctx.quotas_for(head.client_id)
        grant = quotas.fetch_grant
        fetch_max_bytes = quotas.fetch_max_bytes
        least = quotas.fetch_grant_least
        max_bytes = head.max_bytes

        def check(frame):
            given = grant(ctx.now)
            if given is None:  # window mode: Kafka's cap
                cap = fetch_max_bytes()
                return cap is None or max_bytes <= max(int(cap), 1)
            return max_bytes <= given and given >= least()

        return check

    def on_request(self, ctx, head, inflight):
        if head.api_key == apis.FETCH and not client_quotas_apply(head.api_key, head.replica_id):
            return None
        quotas = ctx.quotas_for(head.client_id or "")
        cap = quotas.fetch_cap  # the grant QuotaAccounting gave it
        if cap is None:
            cap = quotas.fetch_max_bytes()  # window mode: Kafka's cap
        if cap is None:
            return None
        return _capped(head, max(int(cap), 1))


def _capped(head, cap):
    """A Fetch or ShareFetch asking for no more than ``cap`` (Forward of the
    patched head: max_bytes, each partition's max for Fetch v0-2, MaxBytes),
    or None when it asks for no more already."""
    if head.api_key == apis.SHARE_FETCH:
        at = head.share_fetch_max_bytes_offset
        if INT32.unpack_from(head.buf, at)[0] <= cap:
            return None
        return Forward(with_int32(head.buf, at, cap))
    if head.api_version < 3:
        patched = capped_fetch_partitions(head.buf, cap)
    else:
        patched = capped_fetch_head(head, cap)
    return None if patched is None else Forward(patched)
