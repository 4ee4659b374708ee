"""Mutation testing in parallel: enumerate mutants here, run them on a machine with many cores.

Two steps, because the machine that has the cores may lack mutmut and the network:

1. ``enumerate`` (needs mutmut 2.5, from the dev extra) asks mutmut's own mutation code for every
   mutant of the named modules and writes them to a JSON file: for each module its path, the
   SHA-256 of the source the mutants were made from, the unit tests that judge it, and per mutant
   the line it mutates, the replacement lines (``hunks``: ``[first, last, new_lines]`` over the
   original's 0-based line numbers) and a unified diff for people to read.
2. ``run`` (needs only Python 3.11+, pytest and the project's test dependencies) starts N
   workers. Each worker has its own copy of the source tree laid out as the installed ``tandem``
   package (``pyproject.toml``'s ``package-dir``), first on ``PYTHONPATH``; it applies one mutant
   at a time to its copy, runs that module's tests in a fresh ``python -P -m pytest -x`` with a
   per-mutant timeout, and restores the file. The coordinator appends each result as one JSON
   line to ``<out>/results.jsonl`` the moment it arrives (so a run cut short keeps everything
   that finished), prints progress, and at the end appends the counts per module as the file's
   last line (``"id": "summary"``) and prints them with every mutant that was not killed.
   ``<out>`` holds that one file only: the GPU machine's tool returns a few files at most.

Outcomes: ``killed`` (the tests failed, or the mutant broke an import), ``timeout`` (the tests ran
past the per-mutant limit: counted as caught, as mutmut does), ``survived`` (every test passed),
``error`` (pytest collected nothing or crashed in a way that says nothing about the mutant).
Before any mutant of a module runs, its tests run once unmutated (``baseline``): a module whose
baseline does not pass with at least one test actually run is skipped, because every mutant
would otherwise read as killed (or, with every test skipped, as survived).

A source file that no longer matches the SHA-256 recorded at enumeration is refused (the line
numbers would be wrong); re-run ``enumerate``.

    # here: which mutants
    .venv/bin/python scripts/mutation_parallel.py enumerate sampler detokenizer --out /tmp/m.json
    # anywhere: run them (1 worker here, 15 on a 16-core machine)
    python3 scripts/mutation_parallel.py run --mutants /tmp/m.json --workers 1 --out /tmp/mut-out
    # one mutant again (e.g. after adding a test): --only sampler:17,sampler:40
"""

from __future__ import annotations

import argparse
import ast
import difflib
import hashlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Module name -> (source path, pytest arguments, top-level names left out of the mutation scope).
# The tests are the module's fast unit tests (no GPU, no server processes).
_SCHEDULER_TESTS = [
    "tests/unit/test_scheduler.py",
    "tests/unit/test_overlap_scheduling.py",
    "--deselect",
    "tests/unit/test_overlap_scheduling.py::test_padded_graph_buffers_read_pending_tokens",
]
# test_frontend_reliability.py takes ~20 s (real waits); the other request-path tests ~2 s.
_REQUEST_TESTS = ["tests/unit/test_request_validation.py", "tests/unit/test_frontend_reliability.py"]
MODULES: dict[str, tuple[str, list[str], list[str]]] = {
    "sampler": ("engine_service/sampler.py", ["tests/unit/test_sampler.py"], []),
    "detokenizer": ("frontend/detokenizer.py", ["tests/unit/test_detokenizer.py"], []),
    "scheduler": ("engine_service/scheduler.py", _SCHEDULER_TESTS, []),
    "request_builder": ("frontend/request_builder.py", ["tests/unit/test_request_builder.py", *_REQUEST_TESTS], []),
    "choice_state": ("frontend/choice_state.py", ["tests/unit/test_choice_state.py", *_REQUEST_TESTS], []),
    # The request validation only: the Struct conversions at the end are not validation.
    "protocol": (
        "tandem/protocol.py",
        ["tests/unit/test_protocol_validation.py", "tests/unit/test_request_validation.py",
         "tests/unit/test_generation_defaults.py"],
        ["kv_transfer_to_proto", "to_struct"],
    ),
    "stopping": ("engine_service/stopping.py", ["tests/unit/test_stopping.py"], []),
    "stops": ("frontend/stops.py", ["tests/unit/test_stops.py"], []),
    "request_ids": ("frontend/request_ids.py", ["tests/unit/test_request_ids.py"], []),
    "kv_cache": ("engine_service/kv_cache.py",
                 ["tests/unit/test_block_manager.py", "tests/unit/test_scheduler.py"], []),
}


# -- enumerate ----------------------------------------------------------------------------------


def _scope_lines(source: str, excluded: list[str]) -> set[int]:
    """1-based line numbers of the top-level statements that may be mutated: everything except
    imports, the module docstring and the top-level definitions named in `excluded`."""
    lines: set[int] = set()
    tree = ast.parse(source)
    for i, node in enumerate(tree.body):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        names: list[str] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
        if any(n in excluded for n in names):
            continue
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        lines.update(range(first, node.end_lineno + 1))
    return lines


def enumerate_module(name: str) -> dict:
    """Every mutant mutmut 2.5 makes of one module, as replacement hunks against its source."""
    from mutmut import Context, list_mutations, mutate  # mutmut 2.x (the dev extra)

    path, tests, excluded = MODULES[name]
    source = (REPO / path).read_text()
    scope = _scope_lines(source, excluded)
    ids = list_mutations(Context(source=source, filename=path))
    original = source.splitlines(keepends=True)
    mutants = []
    for mutation_id in ids:
        if mutation_id.line_number + 1 not in scope:  # mutmut's line numbers are 0-based
            continue
        mutated, performed = mutate(Context(source=source, filename=path, mutation_id=mutation_id))
        if performed != 1 or mutated == source:
            continue
        new = mutated.splitlines(keepends=True)
        matcher = difflib.SequenceMatcher(a=original, b=new, autojunk=False)
        hunks = [[i1, i2, new[j1:j2]] for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal"]
        diff = "".join(difflib.unified_diff(original, new, f"a/{path}", f"b/{path}", n=1))
        mutants.append({
            "id": f"{name}:{len(mutants) + 1}",
            "line": mutation_id.line_number + 1,
            "hunks": hunks,
            "diff": diff,
        })
    return {
        "module": name,
        "path": path,
        "sha256": hashlib.sha256(source.encode()).hexdigest(),
        "tests": tests,
        "mutants": mutants,
    }


def cmd_enumerate(args: argparse.Namespace) -> None:
    modules = [enumerate_module(name) for name in args.modules]
    Path(args.out).write_text(json.dumps({"modules": modules}, indent=1) + "\n")
    for m in modules:
        print(f"{m['module']}: {len(m['mutants'])} mutants of {m['path']}")


# -- run ----------------------------------------------------------------------------------------


def _package_dirs(repo: Path) -> dict[str, str]:
    """`pyproject.toml`'s package-dir: dotted package -> folder in the repository."""
    import tomllib

    with open(repo / "pyproject.toml", "rb") as f:
        return dict(tomllib.load(f)["tool"]["setuptools"]["package-dir"])


def _installed_path(repo: Path, source_path: str) -> Path:
    """Where a repository file lands in the installed layout, relative to the site folder."""
    best = ("", "")
    for package, folder in _package_dirs(repo).items():
        if source_path.startswith(folder.rstrip("/") + "/") and len(folder) > len(best[1]):
            best = (package, folder)
    if not best[0]:
        raise ValueError(f"{source_path} is in no package of pyproject.toml")
    package, folder = best
    return Path(*package.split(".")) / source_path[len(folder.rstrip("/")) + 1:]


_SKIP = shutil.ignore_patterns(".git", ".venv", ".whl", "build", "dist", "__pycache__", "*.pyc", ".mutmut-cache",
                               "node_modules", "results", "*.egg-info", ".pytest_cache")


def build_tree(repo: Path, root: Path) -> Path:
    """A private copy of the repository (tests, sources) plus `site/`, the installed `tandem`
    package laid out from it; returns `site/`, which goes first on the workers' PYTHONPATH."""
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(repo, root / "repo", ignore=_SKIP, symlinks=True)
    site = root / "site"
    # Shallow packages first so deeper folders (tandem.engine_service.models) overlay them.
    for package, folder in sorted(_package_dirs(repo).items(), key=lambda kv: kv[0].count(".")):
        shutil.copytree(root / "repo" / folder, site / Path(*package.split(".")), ignore=_SKIP,
                        dirs_exist_ok=True)
    return site


@dataclass
class Task:
    kind: str  # "baseline" or "mutant"
    module: dict
    mutant: dict | None = None


def _apply(text: str, hunks: list) -> str:
    lines = text.splitlines(keepends=True)
    for first, last, new in sorted(hunks, key=lambda h: h[0], reverse=True):
        lines[first:last] = new
    return "".join(lines)


_RUNNING: list[subprocess.Popen | None] = [None]  # the worker's pytest process, for SIGTERM


def _stop_worker(signum, frame) -> None:
    """SIGTERM to a worker: end its tests' process group (started as a new session), then exit."""
    proc = _RUNNING[0]
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    os._exit(1)


def _run_tests(repo_copy: Path, site: Path, tests: list[str], timeout: float, log: Path) -> tuple[str, float, str]:
    """One pytest run in a new process group; (outcome, seconds, last summary line)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
           "-p", "tandem_mutation_plugin", *tests]
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=repo_copy, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        _RUNNING[0] = proc
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "timeout", time.monotonic() - t0, ""
    seconds = time.monotonic() - t0
    tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    summary = tail[-1] if tail else ""
    if rc == 0:
        return "survived", seconds, summary
    if rc in (1, 2, 3):  # tests failed / collection interrupted (import error) / internal error
        return "killed", seconds, summary
    return "error", seconds, summary  # 4: usage, 5: nothing collected, <0: signal


def cmd_worker(args: argparse.Namespace) -> None:
    """One worker: reads tasks as JSON lines on stdin, answers one JSON line each on stdout."""
    signal.signal(signal.SIGTERM, _stop_worker)
    root = Path(args.root)
    site = build_tree(REPO, root)
    # The plugin that lets the tests find carried tokenizer files (see _PLUGIN below).
    (site / "tandem_mutation_plugin.py").write_text(_PLUGIN)
    repo_copy = root / "repo"
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        task = json.loads(line)
        module = task["module"]
        target = site / _installed_path(REPO, module["path"])
        original = target.read_text()
        if hashlib.sha256(original.encode()).hexdigest() != module["sha256"]:
            print(json.dumps({"id": task.get("id"), "module": module["module"], "outcome": "stale",
                              "note": f"{module['path']} differs from the enumerated source"}), flush=True)
            continue
        mutant = task.get("mutant")
        log = root / "last.log"
        try:
            if mutant:
                target.write_text(_apply(original, mutant["hunks"]))
            outcome, seconds, summary = _run_tests(repo_copy, site, module["tests"], task["timeout"], log)
        finally:
            target.write_text(original)
        if outcome == "timeout" and task.get("cut_by_deadline"):
            outcome = "unfinished"
        result = {"module": module["module"], "outcome": outcome, "seconds": round(seconds, 2),
                  "summary": summary}
        if mutant:
            result.update(id=mutant["id"], line=mutant["line"], diff=mutant["diff"])
        else:
            # Which version of the tests judged this module (the tree may change between runs).
            test_files = {t: hashlib.sha256((repo_copy / t).read_bytes()).hexdigest()[:16]
                          for t in module["tests"] if t.endswith(".py") and (repo_copy / t).is_file()}
            result.update(id=f"{module['module']}:baseline", tests_sha256=test_files,
                          log=log.read_text(errors="replace")[-3000:])
        print(json.dumps(result), flush=True)


# A pytest plugin for machines without the embedded model's GGUF: with TANDEM_MUTATION_TOKENIZERS
# set to a folder holding `smollm2-tokenizer/` (what test_detokenizer.py's fixture builds from
# the GGUF) and `smollm2-converted/` (the converted model's folder without its weights), the
# detokenizer fixture finds its tokenizer already built and `resolve_model` answers the
# embedded name with the converted folder. Without the variable it does nothing.
_PLUGIN = '''
import json
import os
import shutil
from pathlib import Path


def pytest_sessionstart(session):
    carried = os.environ.get("TANDEM_MUTATION_TOKENIZERS")
    if not carried:
        return
    carried = Path(carried)
    base = session.config._tmp_path_factory.getbasetemp()
    if not (base / "smollm2-tokenizer").exists():
        shutil.copytree(carried / "smollm2-tokenizer", base / "smollm2-tokenizer")
    from tandem.engine_service import loader

    original = loader.resolve_model
    converted = carried / "smollm2-converted"

    def resolve_model(spec, cache_dir=None):
        if spec == "smollm2-135m-instruct":
            config = json.loads((converted / "config.json").read_text())
            return loader.ResolvedModel(path=str(converted), config=config, is_dummy=False)
        return original(spec, cache_dir)

    loader.resolve_model = resolve_model
'''


class Coordinator:
    """Hands tasks to workers in order (a module's baseline before its mutants) and records each
    result as soon as it arrives; stops starting mutants that could not finish by the deadline."""

    def __init__(self, args: argparse.Namespace, modules: list[dict]) -> None:
        self.args = args
        self.modules = modules
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.results_file = open(self.out / "results.jsonl", "a")
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.deadline
        self.timeouts: dict[str, float] = {}  # module -> per-mutant timeout, once its baseline passed
        self.expected: dict[str, float] = {}  # module -> seconds its baseline took
        self.skipped: dict[str, str] = {}
        self.pending: list[Task] = [Task("baseline", m) for m in modules]
        for m in modules:
            self.pending += [Task("mutant", m, mu) for mu in m["mutants"]]
        self.counts: dict[str, dict[str, int]] = {m["module"]: {} for m in modules}
        self.last_summary = 0.0

    def _expected(self, name: str) -> float:
        """A generous guess of one passing run's length (a surviving mutant runs every test)."""
        return 1.5 * self.expected[name] + 5

    def _next_task(self) -> Task | None:
        now = time.monotonic()
        for i, task in enumerate(self.pending):
            name = task.module["module"]
            if name in self.skipped:
                continue
            if task.kind == "mutant":
                if name not in self.timeouts:
                    continue  # its baseline is still running
                if now + self._expected(name) > self.deadline:
                    continue  # would very likely not finish in time
            return self.pending.pop(i)
        return None

    def _record(self, result: dict) -> None:
        self.results_file.write(json.dumps(result) + "\n")
        self.results_file.flush()
        os.fsync(self.results_file.fileno())
        name = result["module"]
        if result["id"].endswith(":baseline"):
            ok = result["outcome"] == "survived" and " passed" in result["summary"]
            if ok:
                self.expected[name] = result["seconds"]
                self.timeouts[name] = min(self.args.max_timeout, self.args.timeout_factor * result["seconds"] + 10)
            else:
                self.skipped[name] = f"baseline {result['outcome']}: {result['summary']}"
        else:
            c = self.counts[name]
            c[result["outcome"]] = c.get(result["outcome"], 0) + 1
        if time.monotonic() - self.last_summary > 60:
            self.write_summary()

    def summary(self) -> dict:
        return {
            "elapsed_s": round(time.monotonic() - self.t0, 1),
            "workers": self.args.workers,
            "modules": {
                m["module"]: {
                    "path": m["path"],
                    "mutants": len(m["mutants"]),
                    "per_mutant_timeout_s": self.timeouts.get(m["module"]),
                    "skipped": self.skipped.get(m["module"]),
                    "outcomes": self.counts[m["module"]],
                    "not_run": len(m["mutants"]) - sum(self.counts[m["module"]].values()),
                }
                for m in self.modules
            },
        }

    def write_summary(self, final: bool = False) -> None:
        """Progress on stdout; at the end, the summary as the results file's last line (one
        file under `out`: the GPU machine's tool returns only a few files)."""
        self.last_summary = time.monotonic()
        summary = self.summary()
        if final:
            self.results_file.write(json.dumps({"id": "summary", **summary}) + "\n")
            self.results_file.flush()
            return
        counts = " ".join(f"{name}={dict(m['outcomes'])}" for name, m in summary["modules"].items() if m["outcomes"])
        print(f"[{summary['elapsed_s']:.0f} s] {counts}", flush=True)

    def run(self) -> None:
        work = Path(self.args.work) if self.args.work else Path(tempfile.mkdtemp(prefix="tandem-mutation-"))
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("MKL_NUM_THREADS", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        sel = selectors.DefaultSelector()
        workers = []
        for k in range(self.args.workers):
            proc = subprocess.Popen(
                [sys.executable, "-P", str(Path(__file__).resolve()), "worker", "--root", str(work / f"w{k}")],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, bufsize=1)
            workers.append(proc)
            sel.register(proc.stdout, selectors.EVENT_READ, proc)
        idle: list[subprocess.Popen] = []
        busy: set[int] = set()
        try:
            while sel.get_map():
                while idle:
                    task = self._next_task()
                    if task is None:
                        break
                    proc = idle.pop()
                    name = task.module["module"]
                    timeout = self.args.max_timeout if task.kind == "baseline" else self.timeouts[name]
                    # A mutant still running at the deadline is stopped and recorded as
                    # "unfinished" (not counted), so the whole run ends by the deadline.
                    left = self.deadline - time.monotonic()
                    payload = {"module": {k: v for k, v in task.module.items() if k != "mutants"},
                               "mutant": task.mutant, "timeout": max(1.0, min(timeout, left)),
                               "cut_by_deadline": left < timeout}
                    proc.stdin.write(json.dumps(payload) + "\n")
                    proc.stdin.flush()
                    busy.add(proc.pid)
                starting = len(sel.get_map()) - len(idle) - len(busy)  # still building their trees
                if not busy and not starting and not self._next_task_possible():
                    break
                if time.monotonic() > self.deadline + 5:
                    break  # a safety net: timeouts keep every started mutant inside the deadline
                for key, _ in sel.select(timeout=1.0):
                    proc = key.data
                    line = proc.stdout.readline()
                    if not line:  # the worker died
                        sel.unregister(proc.stdout)
                        busy.discard(proc.pid)
                        if proc in idle:
                            idle.remove(proc)
                        continue
                    msg = json.loads(line)
                    busy.discard(proc.pid)
                    idle.append(proc)
                    if not msg.get("ready"):
                        self._record(msg)
        finally:
            for proc in workers:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
            for proc in workers:
                try:
                    proc.wait(timeout=3)
                except subprocess.TimeoutExpired:
                    proc.terminate()  # the worker kills its running tests' process group
                    try:
                        proc.wait(timeout=3)
                    except subprocess.TimeoutExpired:
                        proc.kill()
            self.write_summary(final=True)
            self.results_file.close()

    def _next_task_possible(self) -> bool:
        """False once nothing left could still start: every pending task belongs to a skipped
        module, or would end past the deadline."""
        now = time.monotonic()
        for task in self.pending:
            name = task.module["module"]
            if name in self.skipped:
                continue
            if task.kind == "baseline" or name not in self.timeouts:
                return True
            if now + self._expected(name) <= self.deadline:
                return True
        return False


def cmd_run(args: argparse.Namespace) -> None:
    data = json.loads(Path(args.mutants).read_text())
    modules = data["modules"]
    if args.modules:
        by_name = {m["module"]: m for m in modules}
        modules = [by_name[n] for n in args.modules]
    if args.only:
        wanted = set(args.only.split(","))
        modules = [dict(m, mutants=[mu for mu in m["mutants"] if mu["id"] in wanted]) for m in modules]
        modules = [m for m in modules if m["mutants"]]
    if args.skip_tests:
        modules = [dict(m, tests=[t for t in m["tests"] if t not in args.skip_tests]) for m in modules]
    for m in modules:
        print(f"{m['module']}: {len(m['mutants'])} mutants, tests {' '.join(m['tests'])}", flush=True)
    coord = Coordinator(args, modules)

    def _terminate(signum, frame) -> None:  # e.g. an outer `timeout`: stop workers, keep results
        raise SystemExit(1)

    signal.signal(signal.SIGTERM, _terminate)
    coord.run()
    print_report(Path(args.out) / "results.jsonl")


def print_report(results: Path) -> None:
    """Counts per module and every mutant not killed, one line each (what a terminal, or the
    last lines of a remote command's output, should show)."""
    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    summaries = [r for r in rows if r.get("id") == "summary"]
    if summaries:
        for name, m in summaries[-1]["modules"].items():
            print(f"{name}: {m['mutants']} mutants, {dict(m['outcomes'])}, not run {m['not_run']}"
                  + (f", skipped: {m['skipped']}" if m["skipped"] else ""))
    for r in rows:
        if r.get("id", "").endswith(":baseline") or r.get("id") == "summary" or r["outcome"] == "killed":
            continue
        changed = [ln for ln in r.get("diff", "").splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
        print(f"{r['outcome'].upper()} {r['id']} line {r.get('line')}: {' | '.join(x.strip() for x in changed)[:160]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("enumerate", help="write the mutants of the named modules to a JSON file")
    e.add_argument("modules", nargs="+", choices=sorted(MODULES))
    e.add_argument("--out", required=True)
    r = sub.add_parser("run", help="run the mutants of a JSON file with N workers")
    r.add_argument("--mutants", required=True)
    r.add_argument("--modules", nargs="*", help="only these modules, in this order (default: the file's order)")
    r.add_argument("--only", help="comma-separated mutant ids, e.g. sampler:3,sampler:17")
    r.add_argument("--skip-tests", nargs="*", default=[],
                   help="test files left out of every module's tests (a quicker, weaker judge)")
    r.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    r.add_argument("--deadline", type=float, default=520.0, help="seconds; no mutant starts that could end later")
    r.add_argument("--timeout-factor", type=float, default=3.0, help="per-mutant timeout = factor x baseline + 10 s")
    r.add_argument("--max-timeout", type=float, default=120.0)
    r.add_argument("--out", required=True)
    r.add_argument("--work", help="folder for the workers' copies (default: a new temporary folder)")
    rep = sub.add_parser("report", help="print the counts and the mutants not killed of a results file")
    rep.add_argument("results")
    w = sub.add_parser("worker", help=argparse.SUPPRESS)
    w.add_argument("--root", required=True)
    args = p.parse_args()
    if args.cmd == "report":
        print_report(Path(args.results))
        return
    {"enumerate": cmd_enumerate, "run": cmd_run, "worker": cmd_worker}[args.cmd](args)


if __name__ == "__main__":
    main()
