"""Human-readable forms of a job's FDG: text (``msrl graph``) and a picture. Formatting only:
what is measured by running the job (bytes per boundary, captures, compiled targets) is measured
by the caller (:func:`msrl.run.cli.main`'s ``graph``) and passed in."""

from __future__ import annotations

import pathlib
from typing import Mapping

from msrl.graph import COMM_KINDS, Graph, Node, NodeKind
from msrl.graph.regions import region_of
from msrl.run.job import METHODS, Job
from msrl.runtime.programs.capture import resolve_capture

__all__ = ["format_graph", "format_job", "format_boundary_bytes", "format_capture", "format_compile", "draw_fragments"]


def _shape(shape: object) -> str:
    if isinstance(shape, tuple):
        return "(" + ", ".join(_shape(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
    return "" if shape is None else str(shape)


def _fmt_values(node: Node) -> str:
    vals = node.meta.get("values", {})
    parts = []
    for name in node.outputs:
        info = vals.get(name)
        if info is None:
            continue
        shape = info["shape"]
        if isinstance(shape, dict):
            items = [f"{k}: {_shape(v) or 'scalar'}" for k, v in list(shape.items())[:3]]
            shape = "{" + ", ".join(items) + (", ..." if len(shape) > 3 else "") + "}"
        else:
            shape = _shape(shape)
        dtype = f" {info['dtype']}" if info.get("dtype") else ""
        parts.append(f"{name}: {info['type']}{shape}{dtype} {info['kind']}")
    return f"    [{'; '.join(parts)}]" if parts else ""


def format_graph(graph: Graph, indent: int = 0) -> str:
    """One line per node (``%id kind ... -> outputs  file:line``), loop bodies and the two
    sides of a branch region indented (``else:`` between them), with
    probe info (shape, dtype, sharded/replicated) where present."""
    lines = []
    pad = "  " * indent
    for node in graph:
        lines.append(f"{pad}{node.describe()}    # {node.where()}{_fmt_values(node)}")
        region = region_of(node)
        for (_, label), sub in zip(region.subgraphs if region is not None else (), node.regions()):
            if not len(sub) and len(region.subgraphs) > 1:  # an empty side of a branch is not printed
                continue
            if label is not None:
                lines.append(f"{pad}{label}")
            lines.append(format_graph(sub, indent + 1))
    return "\n".join(lines)


def _component_notes(job: Job) -> list[str]:
    """What components say of themselves beyond the graph (a component's optional
    ``describe() -> str``: self-play's opponent pool), one line per fragment and role."""
    notes = []
    for fr in job.fragment_graph.fragments:
        for role in fr.spec.roles:
            try:
                component = job.component(role)
            except (KeyError, IndexError, AttributeError):  # not built in this process
                continue
            describe = getattr(component, "describe", None)
            if callable(describe):
                notes.append(f"- {role} (fragment {fr.name}, each of {fr.spec.replicas} replicas): {describe()}")
    return notes


def format_job(job: Job) -> str:
    """The traced graphs, the fragments with their programs' graphs, the boundaries and the
    generated programs: everything ``msrl graph`` prints."""
    fg = job.fragment_graph
    out = [f"# msrl graph: algorithm {job.spec.algorithm.name}, env {job.spec.env_id}, policy {fg.policy.name}"]
    out.append(f"# {fg.policy.description}")
    for method in METHODS:
        out.append(f"\n## traced graph: {fg.graphs[method].name}")
        out.append(format_graph(fg.graphs[method]))
    out.append("\n## fragments")
    for fr in fg.fragments:
        s = fr.spec
        mode = resolve_capture(s.capture, s.device)
        out.append(f"- {fr.name}: roles {', '.join(s.roles)}; replicas {s.replicas}; backend {s.backend}; device {s.device}; "
                   f"capture {mode}{' (default)' if s.capture is None else ''}"
                   + (f"; compile {s.compile}" if s.compile is not None else ""))
    notes = _component_notes(job)
    if notes:
        out.append("\n## component notes")
        out.extend(notes)
    out.append("\n## boundaries")
    if not fg.boundaries:
        out.append("(none)")
    for b in fg.boundaries:
        axis = f", axis {b.axis}" if b.axis is not None else ""
        if b.channel == "fifo":
            how = f"fifo queue of {b.capacity} per producer, {b.pattern.value}"
        elif b.channel == "latest":
            how = f"latest-value slot, {b.pattern.value}"
        elif b.channel == "fresh":
            how = f"fresh latest-value slot (each read a new version), {b.pattern.value}"
        else:
            how = f"sync {b.comm_kind.value}"
        if b.pattern is NodeKind.REDUCE:
            how += f" ({b.reduce or 'sum'} over {b.src}'s {b.src_replicas} replicas)"
        cls = f" [{b.boundary_class}]" if b.boundary_class else ""
        plan = fg.inference
        if plan is not None and b.method == "train_step" and {b.src, b.dst} == {plan.server, plan.clients}:
            how = f"fifo queue of {b.capacity} per {plan.clients} replica (central inference), {b.pattern.value}"
        out.append(f"- {b.name}: {how} {b.value} {b.src} (x{b.src_replicas}) -> {b.dst} (x{b.dst_replicas}), "
                   f"{b.value_kind}{axis}{cls}")
    if fg.collectives:
        out.append("\n## collectives")
    for c in fg.collectives:
        step = c.gradient_step
        size = f": {step['tensors']} tensors, {_human(step['bytes'])} per step" if step else ""
        what, when = (("gradients", "gradient step") if c.value == "gradients"
                      else ("running statistics", "reduce_statistics"))
        out.append(f"- {c.name}: all-reduce (mean) of the learner's {what} over {c.fragment}'s {c.replicas} replicas "
                   f"at every {when} of {c.call}{size.replace('per step', 'per ' + when) if size else ''}")
    plan = fg.inference
    if plan is not None:
        deadline = "no deadline" if plan.timeout_ms is None else f"or after {plan.timeout_ms:g} ms"
        out.append("\n## central inference")
        out.append(f"- {plan.server} runs the first {plan.region} top-level node(s) of its train_step once per "
                   f"{plan.clients} replica (x{plan.clients_count}), side by side")
        out.append(f"- {plan.role} calls there are batched: a batch closes at {plan.max_batch} request(s) (or every "
                   f"{plan.clients} replica still in its rollout), {deadline}")
        if plan.shard_roles:
            out.append(f"- one shard of {', '.join(plan.shard_roles)} per {plan.clients} replica; calls after the "
                       f"rollout concatenate the shards' results: "
                       + (", ".join(f"{r}.{m} (axis {', '.join(map(str, a)) or '-'})" for (r, m), a in plan.combine.items())
                          or "none"))
    for fr in fg.fragments:
        for method in METHODS:
            out.append(f"\n## fragment {fr.name}: {method}")
            out.append(format_graph(fr.programs[method]))
            out.append(f"\n### generated program ({fr.spec.backend})")
            out.append(job.programs[(fr.name, method)].source.rstrip())
    return "\n".join(out) + "\n"


def format_boundary_bytes(job: Job, measured: Mapping[str, int]) -> str:
    """What each ``train_step`` boundary moves per iteration: ``measured`` is
    :meth:`~msrl.run.job.Job.measure_boundary_bytes` (boundary or collective name -> tensor bytes
    of one iteration, every replica's sends; a loop's boundaries once per trip): what a value
    returned across fragments costs."""
    out = ["\n## bytes per train_step iteration (measured on one iteration)"]
    rows = [b for b in job.fragment_graph.boundaries if b.method == "train_step"]
    collectives = [c for c in job.fragment_graph.collectives if c.method == "train_step"]
    if not rows and not collectives:
        out.append("(no boundaries)")
    for b in rows:
        out.append(f"- {b.name}: {_moved(measured, b.name, b.in_branch)} ({b.src} -> {b.dst}"
                   f"{', in a loop' if b.in_loop else ''}{', in a branch' if b.in_branch else ''})")
    for c in collectives:
        out.append(f"- {c.name}: {_moved(measured, c.name, c.in_branch)} (all-reduce over {c.fragment}'s replicas, "
                   f"every replica's contribution{', in a loop' if c.in_loop else ''})")
    plan = job.fragment_graph.inference
    if plan is not None:  # what the serve region's requests and answers move, over its boundaries
        served = [b for b in rows if {b.src, b.dst} == {plan.server, plan.clients}]
        out.append(f"- serve region ({plan.server} serving {plan.role} to {plan.clients} x{plan.clients_count}): "
                   f"{_human(sum(measured.get(b.name, 0) for b in served))} over its {len(served)} boundaries")
    return "\n".join(out) + "\n"


def _moved(measured: Mapping[str, int], name: str, in_branch: bool) -> str:
    """What ``name`` moved in the measured iteration; a boundary inside a branch the iteration did
    not take says so rather than "0 B" (it moves data when the branch is taken)."""
    if name not in measured and in_branch:
        return "not taken in the measured iteration"
    return _human(measured.get(name, 0))


def _human(n: int) -> str:
    for unit, size in (("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def format_capture(summaries: Mapping[tuple[str, int], str]) -> str:
    """Whether each fragment replica's ``train_step`` is captured (``distribution_policy.capture``),
    as measured by running it as training does -- warm-up, probe, capture, one replay:
    ``summaries`` is (fragment, replica) -> :meth:`~msrl.runtime.replica.Replica.capture_summary`.
    Empty when no fragment asks for capture."""
    if not summaries:
        return ""
    out = ["\n## capture of train_step (measured: warm-up, probe, capture, one replay)"]
    out += [f"- {frag} replica {i}: {line}" for (frag, i), line in sorted(summaries.items())]
    return "\n".join(out) + "\n"


def format_compile(statuses: Mapping[tuple[str, int], list[str]]) -> str:
    """Each compile target of each fragment replica under ``distribution_policy.compile``
    (:mod:`msrl.runtime.programs.compiled`): ``statuses`` is (fragment, replica) ->
    :meth:`~msrl.runtime.replica.Replica.compile_status`; ``inductor`` or why it runs eagerly,
    one line each. Empty when no fragment compiles."""
    out = [f"- {frag} replica {i}: {line}" for (frag, i), lines in sorted(statuses.items()) for line in lines]
    return "\n## compiled methods (distribution_policy.compile)\n" + "\n".join(out) + "\n" if out else ""


def draw_fragments(job: Job, path: str | pathlib.Path, method: str = "train_step") -> pathlib.Path:
    """Draws ``method``'s fragmented graph as PNG: one column per fragment, nodes in program
    order (loop bodies framed), data edges grey, boundaries red.

    Returns:
        the PNG's path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fg = job.fragment_graph
    cols = {fr.name: i for i, fr in enumerate(fg.fragments)}
    pos: dict[tuple[str, int], tuple[float, float]] = {}
    rows: dict[str, list[tuple[Node, int]]] = {}

    def walk(g: Graph, depth: int, items: list[tuple[Node, int]]) -> list[tuple[Node, int]]:
        for n in g:
            items.append((n, depth))
            for region in n.regions():
                walk(region, depth + 1, items)
        return items

    for fr in fg.fragments:
        rows[fr.name] = walk(fr.programs[method], 0, [])
    height = max((len(v) for v in rows.values()), default=1)
    fig, ax = plt.subplots(figsize=(5.5 * len(cols), 0.42 * height + 1.5), dpi=110)
    colors = {NodeKind.CALL: "#cfe2ff", NodeKind.LOOP: "#fff3cd", NodeKind.BRANCH: "#d1e7dd", NodeKind.COMPUTE: "#e2e3e5"}
    for frag, items in rows.items():
        x0 = cols[frag] * 6.0
        ax.text(x0 + 2.2, 1.0, f"{frag} (x{fg.fragment(frag).spec.replicas})", ha="center", fontsize=11, weight="bold")
        for i, (n, depth) in enumerate(items):
            x, y = x0 + 0.4 * depth, -i
            pos[(frag, n.id)] = (x, y)
            fc = "#f8d7da" if n.kind in COMM_KINDS else colors.get(n.kind, "#ffffff")
            label = n.describe()
            label = label if len(label) < 60 else label[:57] + "..."
            ax.text(x, y, label, fontsize=7, family="monospace", va="center",
                    bbox={"boxstyle": "round,pad=0.25", "fc": fc, "ec": "#888888", "lw": 0.5})
    # data edges within each fragment (by value name, nearest previous writer)
    for frag, items in rows.items():
        last: dict[str, Node] = {}
        for n, _ in items:
            for v in n.inputs:
                if v in last:
                    (x1, y1), (x2, y2) = pos[(frag, last[v].id)], pos[(frag, n.id)]
                    ax.annotate("", xy=(x2 - 0.1, y2), xytext=(x1 - 0.1, y1),
                                arrowprops={"arrowstyle": "->", "color": "#999999", "lw": 0.5, "connectionstyle": "arc3,rad=0.3"})
            for v in n.outputs:
                last[v] = n
    # boundaries: src comm node -> dst comm node
    comm: dict[tuple[str, str], tuple[str, int]] = {}
    for frag, items in rows.items():
        for n, _ in items:
            if n.kind in COMM_KINDS:
                comm[(n.target.boundary, n.target.side)] = (frag, n.id)
    for b in fg.boundaries:
        if b.method != method:
            continue
        s, d = comm.get((b.name, "src")), comm.get((b.name, "dst"))
        if s and d:
            (x1, y1), (x2, y2) = pos[s], pos[d]
            ax.annotate("", xy=(x2, y2), xytext=(x1 + 4.0, y1),
                        arrowprops={"arrowstyle": "->", "color": "tab:red", "lw": 1.5})
            ax.text((x1 + 4.0 + x2) / 2, (y1 + y2) / 2 + 0.25, f"{b.comm_kind.value} {b.value}", color="tab:red", fontsize=8, ha="center")
    ax.set_xlim(-0.5, 6.0 * len(cols))
    ax.set_ylim(-height, 1.6)
    ax.axis("off")
    ax.set_title(f"{fg.policy.name}: {method}")
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
