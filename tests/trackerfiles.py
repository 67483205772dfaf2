"""What the trackers and webhooks of a run received, read back for the tests: a local webhook server,
and W&B's offline run files."""

import glob
import http.server
import json
import os
import struct
import threading


class Webhook:
    """A local HTTP server on 127.0.0.1 that keeps the JSON bodies POSTed to it (status: its answer)."""

    def __init__(self, status=200):
        received = self.received = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                received.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
                self.send_response(status)
                self.end_headers()

            def log_message(self, *_):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hooks/secret-part"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def wandb_records(run_dir, run_id="*"):
    """{"history": [{key: value}], "config": {key: value}, "summary": {key: value}, "ids", "project"} of the offline
    W&B runs under run_dir/wandb (every offline-run-* folder, or run_id's: a resumed run is one more), read from their .wandb
    files: W&B's log format (a 7-byte header, then LevelDB-log records of 32 KiB blocks, each record a
    Record protobuf)."""
    from wandb.proto import wandb_internal_pb2

    found = {"history": [], "config": {}, "summary": {}, "ids": set(), "project": None}
    for path in sorted(glob.glob(os.path.join(run_dir, "wandb", f"offline-run-*-{run_id}", "run-*.wandb"))):
        with open(path, "rb") as f:
            data = f.read()
        assert data[:4] == b":W&B"
        pos, pieces = 7, b""
        while pos + 7 <= len(data):
            block_left = 32768 - pos % 32768
            if block_left < 7:  # the block's tail is padding
                pos += block_left
                continue
            length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
            pieces += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # a full record, or the last piece of one
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pieces)
                pieces = b""
                which = record.WhichOneof("record_type")
                if which in ("history", "config", "summary"):
                    items = record.history.item if which == "history" else getattr(record, which).update
                    values = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
                    if which == "history":
                        found["history"].append(values)
                    else:
                        found[which].update(values)
                elif which == "run":  # (its config is the run's settings)
                    found["ids"].add(record.run.run_id)
                    found["project"] = record.run.project
                    found["config"].update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                            for i in record.run.config.update})
    return found
