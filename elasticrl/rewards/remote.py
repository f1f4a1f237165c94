"""A reward served over HTTP: JSON in, JSON out, never pickle.

Request:  POST {"prompts": [...], "completions": [...], "answers": [...]}
Response: {"rewards": [float, ...]} (one per completion)
Timeouts and connection errors are retried with exponential back-off; a malformed answer
fails at once with the endpoint named.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request


def post_json(url: str, body: dict, timeout_s: float, retries: int, backoff_s: float, what: str) -> tuple:
    """POST ``body`` as JSON; (the JSON reply, the attempts that failed before it). Timeouts,
    connection errors and HTTP 5xx are retried with exponential back-off; any other failure,
    or the last retry's, raises RuntimeError naming ``what``."""
    data, last_error = json.dumps(body).encode(), None
    for attempt in range(retries + 1):
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                raw = resp.read()
            break
        except urllib.error.HTTPError as exc:
            if exc.code < 500:  # the endpoint refused the request: retrying will not help
                raise RuntimeError(f"{what} answered HTTP {exc.code}") from None
            last_error = exc
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            last_error = exc
        if attempt < retries:
            time.sleep(backoff_s * 2 ** attempt)
    else:
        raise RuntimeError(f"{what} failed {retries + 1} times: {last_error}")
    try:
        return json.loads(raw.decode()), attempt
    except (UnicodeDecodeError, ValueError):
        raise RuntimeError(f"{what}: the reply is not JSON: {raw[:200]!r}") from None


class RemoteReward:
    def __init__(self, url: str, timeout_s: float = 30.0, retries: int = 3, backoff_s: float = 0.5):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"rewards.remote.url: expected an http(s) URL, got {url!r}")
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s

    def __call__(self, prompts: list[str], completions: list[str], answers: list) -> list[float]:
        reply, _ = post_json(self.url, {"prompts": prompts, "completions": completions, "answers": answers},
                             self.timeout_s, self.retries, self.backoff_s, f"reward endpoint {self.url}")
        rewards = reply.get("rewards") if isinstance(reply, dict) else None
        if not isinstance(rewards, list) or len(rewards) != len(completions) or \
                not all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in rewards):
            raise RuntimeError(f"reward endpoint {self.url}: expected {{\"rewards\": [{len(completions)} numbers]}}, "
                               f"got {str(reply)[:200]}")
        return [float(r) for r in rewards]
