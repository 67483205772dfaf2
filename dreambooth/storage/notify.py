"""--notify_url: a JSON message to a webhook when a run starts, finishes or fails. Slack's incoming
webhooks read "text", Discord's "content"; any other URL gets both and the message's fields. A message
that cannot be sent is one warning line: a webhook never stops a run. The URL (a secret: whoever has it
can post) is never printed, only its host."""

import json
import sys
import urllib.parse
import urllib.request

from dreambooth import errors

TIMEOUT_S = 10


def cause_of(err):
    """A failure's one-line cause for a message: a UserError's own line, else the exception's last line."""
    if isinstance(err, KeyboardInterrupt):
        return "stopped (Ctrl-C or a signal)"
    return str(err) if isinstance(err, errors.UserError) else errors.one_line(err)


def body(url, event, text, fields):
    """The JSON body for url's service."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "hooks.slack.com":
        return {"text": text}
    if host.endswith(("discord.com", "discordapp.com")):
        return {"content": text}
    return {"text": text, "content": text, "event": event, **fields}


def send(url, event, text, **fields):
    """POST the message (event: started | finished | failed) to url; True when the webhook took it."""
    if not url:
        return False
    host = urllib.parse.urlsplit(url).hostname or "?"
    request = urllib.request.Request(url, data=json.dumps(body(url, event, text, fields)).encode(),
                                     headers={"Content-Type": "application/json",
                                              "User-Agent": "dreambooth-on-ray"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            response.read()
        return True
    except Exception as err:  # noqa: BLE001 - a webhook never stops a run
        reason = getattr(err, "reason", None) or type(err).__name__
        if getattr(err, "code", None):
            reason = f"HTTP {err.code} {reason}"
        print(f"warning: --notify_url: the {event} message was not taken by {host} ({reason})", file=sys.stderr)
        return False
