"""The nodes of the Ray cluster this process is connected to: what each holds, and where several share a machine."""

import collections
import os

from dreambooth import errors


def check_resources_held(amounts, workers):
    """UserError unless the Ray cluster holds workers x amounts ({resource: per worker}) now."""
    import ray

    held = ray.cluster_resources()
    short = [f"{need * workers:g} {name} ({held.get(name, 0):g} in the cluster)" for name, need in amounts.items()
             if held.get(name, 0) < need * workers]
    if short:
        raise errors.UserError(f"--resources_per_worker: {workers} worker(s) need {', '.join(short)}: start the nodes "
                               "to train on with ray start --resources='{\"NAME\": N}'")


def shared_temp_folders(nodes):
    """[(host, session folder, nodes)] of the live nodes (ray.nodes()) that run on one machine in one Ray temp folder:
    each node's log monitor tails the same worker logs there, so a driver prints every worker line once per node."""
    places = collections.Counter((node["NodeManagerAddress"], os.path.dirname(os.path.dirname(node["RayletSocketName"])))
                                 for node in nodes if node["Alive"])
    return [(host, folder, count) for (host, folder), count in sorted(places.items()) if count > 1]


def node_cpus():
    """The CPUs of each live node of the Ray cluster this process is connected to."""
    import ray

    return [node["Resources"].get("CPU", 0) for node in ray.nodes() if node["Alive"]]
