"""Requests to OpenAI-compatible servers (the critique judge, plumbing/judge.py; remote
evaluators, plumbing/evaluators.py): the client and our retry policy.

    openai_client(base_url, api_key_env, timeout_s, ...)
                              an openai.OpenAI client with its own retries off
    call_with_retries(call, max_retries, backoff_base_s, backoff_max_s, ...)
                              one request retried on 408/409/429/5xx, timeouts, refused connections
    backoff_delay(attempt, base, cap, u), retry_after_s(headers)
                              equal-jitter exponential backoff; the wait a 429/503 asks for
    failure_text(err)         one line for a failed request ("HTTP 400: <the server's message>")
"""
import datetime
import email.utils
import math
import os
import random
import time


def failure_text(err):
    """One line for a failed request: "HTTP <status>: <the server's message>" for an HTTP error
    (the JSON error's message / detail, else the body's start), "<class>: <text>" for another
    exception (a refused connection: its cause, e.g. "ConnectError: [Errno 111] ..."), a str
    (a reason call_with_retries' `call` gave) as is. At most ~200 characters."""
    import openai
    if isinstance(err, str):
        return err
    if isinstance(err, openai.APIStatusError):
        body = err.body  # the client unwraps OpenAI's {"error": {...}}
        msg = (body.get("message") or body.get("detail") or body) if isinstance(body, dict) else body
        if not msg:
            msg = getattr(err.response, "text", "") or err.message
        return f"HTTP {err.status_code}: {' '.join(str(msg).split())[:200]}"
    cause = err.__cause__ or err
    return f"{type(cause).__name__}: {' '.join(str(cause).split())[:200]}"


def openai_client(base_url, api_key_env, timeout_s, *, where, needed_for):
    """An openai.OpenAI client for an OpenAI-compatible server (the judge, a remote evaluator).

    Args:
        api_key_env: NAME of the environment variable holding the key, or None (a local server:
            it ignores the key, but the client insists on one). timeout_s: seconds per request.
        where, needed_for: for the error message.
    Returns:
        openai.OpenAI with max_retries 0: our call_with_retries does the retrying (and counts it).
    Raises:
        SystemExit (one line): api_key_env names a variable that is not set.
    """
    key = "EMPTY"
    if api_key_env:
        key = os.environ.get(api_key_env)
        if not key:
            raise SystemExit(f"{where}: environment variable {api_key_env} is not set (needed for {needed_for})")
    import openai  # here, not at the top: only these servers need the package
    return openai.OpenAI(base_url=base_url, api_key=key, timeout=float(timeout_s), max_retries=0)


def backoff_delay(attempt, base, cap, u):
    """Seconds to wait before retry `attempt` (0-based): 'equal jitter' exponential backoff,
    d = min(cap, base * 2**attempt), delay = d/2 + u * d/2 with u ~ U[0, 1). Half the delay is
    guaranteed (the server gets a break), the other half spreads the clients out."""
    d = min(cap, base * 2 ** attempt)
    return d / 2 + u * d / 2


def retry_after_s(headers, now=None):
    """The wait a 429/503 answer asks for, in seconds: its retry-after-ms header (OpenAI's), else
    Retry-After as seconds or as an HTTP-date (RFC 9110 §10.2.3).

    Args: headers: the answer's headers (case-insensitive httpx headers, or a lower-case dict).
        now: epoch seconds the HTTP-date is measured from (None: time.time()).
    Returns: float >= 0, or None when there is no such header or it cannot be read.
    """
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        value = (headers.get(name) or "").strip()
        if not value:
            continue
        try:
            secs = float(value) * scale
        except ValueError:
            if scale != 1.0:
                continue
            try:
                when = email.utils.parsedate_to_datetime(value)
            except (TypeError, ValueError, IndexError):
                return None
            if when.tzinfo is None:  # "-0000": UTC, no zone named
                when = when.replace(tzinfo=datetime.timezone.utc)
            secs = when.timestamp() - (time.time() if now is None else now)
        if math.isfinite(secs):
            return max(0.0, secs)
    return None


def call_with_retries(call, max_retries, backoff_base_s, backoff_max_s, sleep=time.sleep, rand=random.random,
                      errors=None):
    """One request to an OpenAI-compatible server, retried: the judge's and the remote evaluator's.

    Retried: HTTP 408/409/429/5xx, timeouts, refused connections, and answers that `call` rejects
    (it returns value None: an HTML page, an unparseable judge answer); other HTTP 4xx are not
    (they will not heal). Waits backoff_delay between tries; after a 429 or 503 that says how long
    to wait (retry_after_s) at least that long, but never over backoff_max_s (the longest wait
    between two tries: a server asking for an hour is retried sooner anyway, and the request then
    fails as any other rather than stalling a training step for that hour).

    Args:
        call: () -> (value, why); raises the openai client's errors.
        max_retries: int, retries after the first try. backoff_base_s, backoff_max_s: backoff_delay's.
        sleep, rand: injectable for tests (waits and jitter draws).
        errors: list or None: each failed try appends its exception (or `call`'s str reason), for
            callers that report the server's message (failure_text, probe_judge).
    Returns:
        (value or None, why str: the last failure's reason, attempts int). Never raises.
    """
    import openai
    why, attempt = "", 0
    for attempt in range(int(max_retries) + 1):
        retry, asked, err = True, None, None
        try:
            value, why = call()
            if value is not None:
                return value, why, attempt + 1
            err = why
        except openai.APIStatusError as e:
            why, err = f"HTTP {e.status_code}", e
            retry = e.status_code in (408, 409, 429) or e.status_code >= 500  # others will not heal
            if e.status_code in (429, 503):
                asked = retry_after_s(e.response.headers)
        except openai.APITimeoutError as e:
            why, err = "timeout", e
        except openai.APIConnectionError as e:
            why, err = f"connection error: {type(e.__cause__ or e).__name__}", e
        except Exception as e:  # anything else (bad JSON body, ...) is a failed call, not a crash
            why, err = f"{type(e).__name__}: {str(e)[:100]}", e
        if errors is not None:
            errors.append(err)
        if not retry or attempt == int(max_retries):
            break
        delay = backoff_delay(attempt, base=backoff_base_s, cap=backoff_max_s, u=rand())
        sleep(delay if asked is None else min(max(delay, asked), backoff_max_s))
    return None, why, attempt + 1
