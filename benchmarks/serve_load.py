"""Load on a running serve.py (R requests from C clients over S subjects) and what its replicas did with it.

    python serve.py --data_prefix "$DATA_PREFIX" &
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --requests 200 --clients 8 --switch_rounds 20

Prints requests/s, p50 and p95 latency, and per replica the adapter loads and evictions while it ran, and the
share of requests that reached a replica already holding their subject. Subjects: --subjects, else every one GET
/v1/subjects lists; each request's prompt names the subject's folder name, its seed is the request's number.
--switch_rounds N: also the cost of an adapter switch, against drawing with the subject's adapters already fused (a
merged model). --api_key (or DREAMBOOTH_API_KEY) when the server asks for one.
"""

import argparse
import collections
import json
import os
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request


def call(url, path, body=None, key=None, timeout=600):
    """(status, parsed JSON or the bytes) of one request to the server at url."""
    request = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(body).encode() if body else None,
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            status, data, kind = answer.status, answer.read(), answer.headers.get("content-type", "")
    except urllib.error.HTTPError as err:
        status, data, kind = err.code, err.read(), err.headers.get("content-type", "")
    except (urllib.error.URLError, ConnectionError) as err:  # (no server there)
        sys.exit(f"error: nothing answers at {url} ({getattr(err, 'reason', err)}): is serve.py running, on that port?")
    return status, json.loads(data) if "json" in kind else data


def run_load(url, subjects, total, clients, key=None, steps=20, prompt="a photo of {subject}, on a beach"):
    """Send total requests from clients threads, round-robin over subjects, request k with seed k: [(subject, seed,
    status, seconds, answer)] in the order they were answered."""
    lock, results, counter = threading.Lock(), [], iter(range(total))

    def client():
        while True:
            with lock:
                number = next(counter, None)
            if number is None:
                return
            subject = subjects[number % len(subjects)]
            began = time.perf_counter()
            status, answer = call(url, "/v1/images", {"subject": subject, "prompt": prompt.format(subject=subject),
                                                      "seed": number, "steps": steps}, key)
            with lock:
                results.append((subject, number, status, time.perf_counter() - began, answer))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def summary(results, seconds):
    """The figures of run_load's results over seconds of wall time: {name: value} and {replica: {loads, subjects,
    evictions, requests, hits}}."""
    ok = [r for r in results if r[2] == 200]
    latencies = sorted(r[3] for r in ok)
    replicas = collections.defaultdict(lambda: {"requests": 0, "loads": 0, "hits": 0, "subjects": set(),
                                                "evicted": []})
    for subject, _, _, _, answer in ok:
        replica = replicas[answer["replica"]]
        replica["requests"] += 1
        replica["subjects"].add(subject)
        replica["loads"] += bool(answer["adapter_loaded"])
        replica["hits"] += not answer["adapter_loaded"]
        replica["evicted"].append(answer["replica_evictions"])  # (the replica's count so far)
    figures = {"requests": len(results), "answered": len(ok), "requests_per_s": len(ok) / seconds if seconds else 0,
               "p50_s": statistics.median(latencies) if latencies else None,
               "p95_s": latencies[max(0, int(round(0.95 * len(latencies))) - 1)] if latencies else None,
               "hit_share": sum(r["hits"] for r in replicas.values()) / len(ok) if ok else None,
               "statuses": dict(collections.Counter(r[2] for r in results))}
    per_replica = {name: {**{k: v for k, v in row.items() if k != "evicted"}, "subjects": len(row["subjects"]),
                          "evictions": max(row["evicted"]) - min(row["evicted"])} for name, row in replicas.items()}
    return figures, per_replica


def switch_overhead(url, subjects, rounds, key=None, steps=20, prompt="a photo of {subject}, on a beach"):
    """The seconds a replica takes to draw one request (its own count, the HTTP path left out) when every request is
    for the same subject (its adapters stay fused: drawing as with a merged model), and when two subjects alternate
    (each request first puts the base's weights back and fuses the other's): {"same": s, "alternating": s}, one
    client, after a request of each to load them; None where the two were drawn on different replicas (other base
    models, or several replicas): no switch to time."""
    first, second = subjects[0], subjects[1]
    replicas = set()

    def seconds(order):
        took = []
        for number, subject in enumerate(order):
            status, answer = call(url, "/v1/images", {"subject": subject, "prompt": prompt.format(subject=subject),
                                                      "seed": number, "steps": steps}, key)
            if status != 200:
                sys.exit(f"error: {subject}: {status} {answer.get('error') if isinstance(answer, dict) else answer}")
            took.append(answer["seconds"])
            replicas.add(answer["replica"])
        return statistics.median(took)

    seconds([first, second])  # (both loaded: no load is timed)
    timed = {"same": seconds([first] * rounds), "alternating": seconds([first, second] * max(1, rounds // 2))}
    return timed if len(replicas) == 1 else None  # (drawn on two replicas: no switch happened)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="The server (default: %(default)s).")
    parser.add_argument("--requests", type=int, default=100, help="R: requests in all (default: %(default)s).")
    parser.add_argument("--clients", type=int, default=4, help="C: clients sending at once (default: %(default)s).")
    parser.add_argument("--subjects", nargs="*", default=None, help="S: the subjects (default: all it serves).")
    parser.add_argument("--steps", type=int, default=20, help="Denoising steps of each image (default: %(default)s).")
    parser.add_argument("--api_key", default=os.environ.get("DREAMBOOTH_API_KEY"),
                        help="The server's key, where it asks for one (default: $DREAMBOOTH_API_KEY).")
    parser.add_argument("--switch_rounds", type=int, default=0,
                        help="Also time an adapter switch: this many requests for one subject, then as many "
                             "alternating between two (one client; a replica holding both).")
    args = parser.parse_args(argv)
    subjects = args.subjects
    if not subjects:
        status, listed = call(args.url, "/v1/subjects", key=args.api_key)
        if status != 200:
            sys.exit(f"error: GET /v1/subjects: {status} {listed.get('error') if isinstance(listed, dict) else listed}"
                     + (" (--api_key, or DREAMBOOTH_API_KEY)" if status == 401 else ""))
        subjects = [row["subject"] for row in listed["subjects"]]
    began = time.perf_counter()
    results = run_load(args.url, subjects, args.requests, args.clients, args.api_key, args.steps)
    figures, replicas = summary(results, time.perf_counter() - began)
    clients = min(args.clients, args.requests)
    print(f"{figures['answered']} of {figures['requests']} requests answered ({figures['statuses']}) from "
          f"{clients} client(s) over {len(subjects)} subject(s), {args.steps} steps an image")
    refused = [(subject, answer) for subject, _, status, _, answer in results if status != 200]
    if refused:
        subject, answer = refused[0]
        print(f"first refusal ({subject}): {answer.get('error') if isinstance(answer, dict) else answer}")
    if figures["answered"]:
        print(f"requests/s {figures['requests_per_s']:.2f}  p50 {figures['p50_s']:.3f} s  p95 {figures['p95_s']:.3f} s"
              f"  reached a replica already holding their subject: {figures['hit_share']:.0%}")
    for name, row in sorted(replicas.items()):
        print(f"replica {name}: {row['requests']} requests, {row['subjects']} subjects, {row['loads']} adapter "
              f"loads, {row['evictions']} evictions")
    if args.switch_rounds and len(subjects) >= 2:
        switch = switch_overhead(args.url, subjects, args.switch_rounds, args.api_key, args.steps)
        if switch is None:
            print(f"switch not timed: {subjects[0]} and {subjects[1]} were drawn on different replicas (other base "
                  "models, or several replicas): name two adapters of one base with --subjects, one replica")
        else:
            print(f"drawing one request: {switch['same']:.3f} s with its subject's adapters fused already (as a merged "
                  f"model), {switch['alternating']:.3f} s when each request switches subject: "
                  f"{switch['alternating'] - switch['same']:+.3f} s a switch (medians of {args.switch_rounds})")
        figures["switch"] = switch
    if not figures["answered"]:
        sys.exit(1)
    return figures, replicas


if __name__ == "__main__":
    main()
