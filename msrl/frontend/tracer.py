"""The tracer: reads ``Trainer.train_step`` with :mod:`ast` and builds the FDG (DESIGN.md §2).

The tracer never runs the loop. It reads the method's source and turns each statement into
nodes of a :class:`~msrl.graph.Graph`. The supported subset of Python:

* ``x = e``, ``a, b = e``, ``x += e``, ``self.attr = e`` (trainer state);
* ``self.<role>.<method>(args, key=value)`` calls of the components (roles
  ``env``/``actor``/``buffer``/``learner``), as statements or inside expressions;
* calls of other trainer methods written in the same subset (inlined; one final ``return``);
* ``for i in range(...)`` loops whose trip count is a control value;
* ``if``/``elif``/``else`` statements and conditional expressions (``a if c else b``) whose
  condition is a control value, traced as ``branch`` regions that every fragment takes in
  step; a component call in a branch runs only when the branch is taken;
* expressions on local values, trainer attributes (``self.hparams.num_steps``) and module
  globals (``torch``), including comprehensions that call no component;
* one ``return e`` as the method's last statement.

**Control values.** A value computed only from hyperparameters (``self.hparams``), constants,
loop indices, the job's sizes (``self.num_envs``: envs over every replica;
``self.total_env_steps``: the budget; ``self.seed``) and other control values, with
arithmetic, comparisons and the builtins in :data:`PURE_CALLS` (and ``math``), is a control
value. Trainer attributes are control state when every assignment to them, in ``reset`` and in
``train_step``, is a control value (``self.global_step += self.num_envs``). Every fragment
computes its own identical copy of a control value; the result of a component call, and
anything computed from one, is data. A plain function of the algorithm's own module
(``linear_schedule(...)``) is inlined and traced like a trainer helper, and NumPy's elementwise
functions (``np.floor``) are pure; calls the tracer cannot tell are deterministic (any other
function: ``torch.rand``, a library's helper) make data. Module globals read by traced code
must be constants (numbers, strings, tuples of them, frozen dataclasses, modules, functions):
a mutable one, or one its module rebinds, is a :class:`TraceError`.

Anything else -- ``while``/``try``/``with``, ``break``/``continue``, a condition or trip count
on data, component calls in comprehensions, lambdas or the right operand of ``and``/``or`` --
raises :class:`TraceError` with ``file:line`` and what to write instead.
"""

from __future__ import annotations

import ast
import copy
import inspect
import itertools
import sys
import textwrap
from typing import Any, Callable

from msrl.api import ROLES, Trainer
from msrl.errors import InputError
from msrl.graph import Const, Graph, Node, NodeKind

__all__ = ["TraceError", "trace", "trace_methods", "check_references", "state_name", "MAX_INLINE_DEPTH", "PURE_CALLS", "READ_ONLY_ATTRS"]

#: Nesting limit of inlined trainer helper methods (guards against recursion).
MAX_INLINE_DEPTH = 8

#: Builtins a control value may call: deterministic functions of their arguments. Calls of
#: ``math.<name>`` are pure too; any other call makes its result data.
PURE_CALLS = frozenset(
    {"abs", "min", "max", "int", "float", "bool", "round", "len", "divmod", "pow", "sum", "str", "tuple",
     "list", "dict", "set", "frozenset", "sorted", "range", "isinstance", "zip", "enumerate", "any", "all",
     "reversed"}
)

#: Trainer attributes set by msrl for the job; readable (as control values), never assigned.
READ_ONLY_ATTRS = ("hparams", "seed", "num_envs", "total_env_steps")

#: The trainer methods traced together (state written in one is read in the other).
TRACED_METHODS = ("reset", "train_step")


class TraceError(InputError):
    """Traced code outside the supported subset.

    Attributes:
        file: the user source file; ``line``: its line; ``advice``: what to write instead.
    """

    def __init__(self, file: str, line: int, message: str, advice: str = "") -> None:
        self.file, self.line, self.message, self.advice = file, line, message, advice
        text = f"{file}:{line}: {message}"
        if advice:
            text += f". {advice}"
        super().__init__(text)


def state_name(attr: str) -> str:
    """The IR value name of trainer attribute ``attr`` (``"obs"`` -> ``"self.obs"``)."""
    return f"self.{attr}"


class _Scope:
    """The value names defined so far in one region, chained to the enclosing region."""

    def __init__(self, graph: Graph, parent: _Scope | None) -> None:
        self.graph, self.parent = graph, parent
        self.names: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.names or (self.parent is not None and self.parent.has(name))

    def top(self) -> _Scope:
        return self if self.parent is None else self.parent.top()


class _Tracer:
    def __init__(self, cls: type, tainted: set[str] | None = None) -> None:
        if not (isinstance(cls, type) and issubclass(cls, Trainer)):
            raise TypeError(f"trace() takes a Trainer subclass, got {cls!r}")
        self.cls = cls
        self.ids = itertools.count()
        self.tmp = itertools.count()
        self.inline = itertools.count()
        self.state_ins = 0
        self.written: list[str] = []
        # value names that hold data (results of component calls and what is computed from
        # them); seeded with what earlier passes found, so the analysis is a fixpoint
        self.tainted: set[str] = set(tainted or ())
        # why a name is data: name -> (file, line, reason), for error messages
        self.why: dict[str, str] = {}
        # names assigned in only one side of a branch and undefined before it
        self.maybe_undefined: dict[str, str] = {}
        self.file = "<unknown>"
        self.depth = 0
        # the module globals of the method being read (its helpers' while they are inlined)
        self.globals: dict[str, Any] = {}

    # -- helpers ----------------------------------------------------------------------------
    def err(self, node: ast.AST, message: str, advice: str = "") -> TraceError:
        return TraceError(self.file, getattr(node, "lineno", 0), message, advice)

    def new_tmp(self, hint: str = "t") -> str:
        """A fresh value name; component results are named after the call
        (``_learner_get_weights2``) so boundaries read well in ``msrl graph``."""
        return f"_{hint}{next(self.tmp)}"

    def emit(self, scope: _Scope, node: Node, at: ast.AST | None, impure: str | None = None) -> Node:
        node.id = next(self.ids)
        if at is not None:
            node.meta.setdefault("file", self.file)
            node.meta.setdefault("line", at.lineno)
        scope.graph.append(node)
        scope.names.update(node.outputs)
        for name in node.outputs:
            self.maybe_undefined.pop(name, None)
        if node.kind in (NodeKind.LOOP, NodeKind.BRANCH):
            return node  # what their bodies write was tainted there
        reason = None
        if node.kind is NodeKind.CALL:
            reason = f"the result of {node.target[0]}.{node.target[1]}() at {node.where()}"
        elif impure is not None:
            node.meta["impure"] = impure
            reason = f"a call of {impure}() at {node.where()}, which msrl cannot tell is deterministic"
        else:
            src = next((n for n in node.inputs if n in self.tainted), None)
            if src is not None:
                reason = self.why.get(src, f"{src!r}, which is data")
        if reason is not None:
            for name in node.outputs:
                self.tainted.add(name)
                self.why.setdefault(name, reason)
        return node

    def check_global(self, name: str, at: ast.AST) -> None:
        """Refuses a module-level name whose value can change while the job runs: a mutable
        object (a dict, list, set, tensor, an instance of a non-frozen class) or a name some
        function of its module rebinds (``global``). The tracer reads module globals as
        constants; every fragment, and every process on Ray, has its own copy of them."""
        value = self.globals[name]
        rebound = name in _rebound_globals(self.globals.get("__name__", ""))
        if rebound or not _immutable(value):
            what = "a name functions of its module rebind (global)" if rebound else f"a mutable {type(value).__name__}"
            raise self.err(at, f"module-level {name!r} is {what}: traced code reads module globals as constants, and "
                               "every fragment (every process on Ray) has its own copy, so a change is seen by one "
                               "fragment only",
                           f"keep it in trainer state (self.{name.lower()} = ... in reset(), updated in train_step) or "
                           "make it an immutable constant")

    def check_control(self, value: str | Const, at: ast.AST, what: str, advice: str, expr: ast.AST | None = None) -> None:
        """Raises TraceError when ``value`` is data (depends on a component's result). ``expr``:
        the source expression of ``value``; where ``value`` is one of the tracer's own temporaries
        (``x.mean() > 0``), the message names that expression and the user's data name it reads,
        never the temporary."""
        if isinstance(value, str) and value in self.tainted:
            name = value
            if value.startswith("_") and expr is not None:  # a temporary: say what the user wrote
                read = [f"self.{n.attr}" if isinstance(n, ast.Attribute) else n.id for n in ast.walk(expr)
                        if isinstance(n, ast.Name) or isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                        and n.value.id == "self"]
                data = next((r for r in read if r in self.tainted), None)
                what = f"{what} `{ast.unparse(expr)}`"
                name = data if data is not None else value
            why = self.why.get(name)
            because = f" (it comes from {why})" if why else ""
            subject = f"depends on {name!r}, which is data" if not name.startswith("_") else "is data"
            raise self.err(at, f"{what} {subject}{because}; data-dependent control flow is not traced", advice)

    def read(self, name: str, at: ast.AST) -> None:
        """Rejects reading a name that an earlier branch may have left unassigned."""
        if name in self.maybe_undefined:
            raise self.err(
                at,
                f"{name!r} is assigned in only one side of the `if` at {self.maybe_undefined[name]} and has no value "
                "before it",
                f"assign {name} before the `if` (e.g. {name} = {{}}) or in both sides",
            )

    def is_method(self, attr: str) -> bool:
        member = inspect.getattr_static(self.cls, attr, None)
        return inspect.isfunction(member)

    def component_call(self, e: ast.AST) -> tuple[str, str] | None:
        """``self.role.method(...)`` -> (role, method)."""
        if (
            isinstance(e, ast.Call)
            and isinstance(e.func, ast.Attribute)
            and isinstance(e.func.value, ast.Attribute)
            and isinstance(e.func.value.value, ast.Name)
            and e.func.value.value.id == "self"
            and e.func.value.attr in ROLES
        ):
            return e.func.value.attr, e.func.attr
        return None

    def helper_call(self, e: ast.AST) -> str | None:
        """``self.helper(...)`` where ``helper`` is a method of the trainer, or ``helper(...)``
        where ``helper`` is a plain function of the traced code's own module -> its name (both
        are inlined and traced by the same rules)."""
        if (
            isinstance(e, ast.Call)
            and isinstance(e.func, ast.Attribute)
            and isinstance(e.func.value, ast.Name)
            and e.func.value.id == "self"
            and e.func.attr not in ROLES
            and self.is_method(e.func.attr)
        ):
            return e.func.attr
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and self.module_function(e.func.id) is not None:
            return e.func.id
        return None

    def module_function(self, name: str) -> Any:
        """The plain function ``name`` of the traced code's own module, or ``None``."""
        fn = self.globals.get(name)
        if inspect.isfunction(fn) and fn.__module__ == self.globals.get("__name__"):
            return fn
        return None

    # -- entry ------------------------------------------------------------------------------
    def trace(self, method: str) -> Graph:
        fn = getattr(self.cls, method, None)
        if not inspect.isfunction(fn):
            raise TypeError(f"{self.cls.__name__}.{method} is not a method")
        funcdef, self.file = self.parse(fn)
        self.globals = fn.__globals__
        args = funcdef.args
        if len(args.args) != 1 or args.vararg or args.kwarg or args.kwonlyargs:
            raise self.err(funcdef, f"{method} must take only self", "pass values as trainer state")
        graph = Graph(f"{self.cls.__name__}.{method}")
        scope = _Scope(graph, None)
        body = list(funcdef.body)
        ret = None
        if body and isinstance(body[-1], ast.Return):
            ret = body.pop()
        self.stmts(body, scope)
        out_value = None
        if ret is not None and ret.value is not None:
            out_value = self.value_of(ret.value, scope)
            if isinstance(out_value, Const):
                out_value = self.compute(ast.Constant(out_value.value), scope, [self.new_tmp()], ret)
        for attr in self.written:
            self.emit(scope, Node(NodeKind.STATE_OUT, attr, inputs=[state_name(attr)]), None)
        self.emit(
            scope,
            Node(NodeKind.OUTPUT, None, inputs=[out_value] if out_value else []),
            ret,
        )
        for i, node in enumerate(graph.walk()):
            node.id = i  # number in program order, for reading
        graph.set_id_base(i + 1)
        graph.lint(defined=set())
        return graph

    def parse(self, fn: Callable[..., Any]) -> tuple[ast.FunctionDef, str]:
        try:
            lines, first = inspect.getsourcelines(fn)
            file = inspect.getsourcefile(fn) or "<unknown>"
        except (OSError, TypeError) as e:
            raise TypeError(f"cannot read the source of {fn.__qualname__}: {e}") from e
        tree = ast.parse(textwrap.dedent("".join(lines)))
        ast.increment_lineno(tree, first - 1)
        funcdef = tree.body[0]
        assert isinstance(funcdef, ast.FunctionDef)
        return funcdef, file

    # -- statements -------------------------------------------------------------------------
    def stmts(self, stmts: list[ast.stmt], scope: _Scope) -> None:
        for s in stmts:
            self.stmt(s, scope)

    def stmt(self, s: ast.stmt, scope: _Scope) -> None:
        if isinstance(s, ast.Assign):
            if len(s.targets) != 1:
                raise self.err(s, "chained assignment is not traced", "write one assignment per line")
            self.assign(s.targets[0], s.value, scope, s)
        elif isinstance(s, ast.AnnAssign):
            if s.value is None:
                return
            self.assign(s.target, s.value, scope, s)
        elif isinstance(s, ast.AugAssign):
            if not isinstance(s.target, (ast.Name, ast.Attribute)):
                raise self.err(s, "augmented assignment to a subscript is not traced", "assign a new value")
            load = ast.copy_location(_as_load(s.target), s)
            self.assign(s.target, ast.copy_location(ast.BinOp(load, s.op, s.value), s), scope, s)
        elif isinstance(s, ast.Expr):
            self.expr_stmt(s, scope)
        elif isinstance(s, ast.For):
            self.for_loop(s, scope)
        elif isinstance(s, ast.Pass):
            return
        elif isinstance(s, ast.If):
            self.branch(
                s.test, lambda inner: self.stmts(s.body, inner), lambda inner: self.stmts(s.orelse, inner), scope, s
            )
        elif isinstance(s, ast.While):
            raise self.err(s, "`while` loops are not traced", "use `for _ in range(n)` with a fixed n")
        elif isinstance(s, ast.Try):
            raise self.err(s, "`try` is not traced", "handle errors inside a component method")
        elif isinstance(s, (ast.With, ast.AsyncWith)):
            raise self.err(s, "`with` is not traced", "move the context manager inside a component method")
        elif isinstance(s, ast.Return):
            raise self.err(s, "`return` is only traced as the last statement of a method", "return once, at the end")
        elif isinstance(s, (ast.Break, ast.Continue)):
            raise self.err(s, f"`{type(s).__name__.lower()}` is not traced", "loops run a fixed trip count")
        else:
            raise self.err(
                s,
                f"`{type(s).__name__}` statements are not traced",
                "train_step may hold assignments, component calls, `for ... in range(...)` and a final return",
            )

    def expr_stmt(self, s: ast.Expr, scope: _Scope) -> None:
        e = s.value
        if isinstance(e, ast.Constant):
            return  # a docstring or a bare literal
        if self.component_call(e):
            self.call(e, scope, [])
        elif self.helper_call(e):
            self.inline_helper(e, scope)
        else:
            raise self.err(
                s,
                "an expression statement that is not a component call has no traced effect",
                "assign its value, or call a component method",
            )

    def assign(self, target: ast.expr, value: ast.expr, scope: _Scope, at: ast.stmt) -> None:
        names, unpack = self.targets(target)
        if self.component_call(value):
            self.call(value, scope, names, unpack=unpack)
        elif self.helper_call(value) and not unpack:
            result = self.inline_helper(value, scope)
            self.compute(ast.Name(result, ast.Load()) if isinstance(result, str) else ast.Constant(result.value), scope, names, at)
        else:
            self.compute(value, scope, names, at, unpack=unpack)
        for n in names:
            if n.startswith("self.") and n[5:] not in self.written:
                self.written.append(n[5:])

    def targets(self, t: ast.expr) -> tuple[list[str], bool]:
        if isinstance(t, ast.Name):
            return [t.id], False
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
            if t.attr in ROLES or t.attr in READ_ONLY_ATTRS:
                raise self.err(t, f"self.{t.attr} is set by msrl and cannot be reassigned in a traced method",
                               f"store your own value under another name (self.my_{t.attr})")
            return [state_name(t.attr)], False
        if isinstance(t, (ast.Tuple, ast.List)):
            names: list[str] = []
            for elt in t.elts:
                sub, nested = self.targets(elt)
                if nested:
                    raise self.err(t, "nested unpacking is not traced", "unpack in two steps")
                names.extend(sub)
            return names, True
        raise self.err(
            t,
            "only assignments to local names, tuples of them, or self.<attr> are traced",
            "assign to a local name; to store into a container, call a Buffer method",
        )

    def for_loop(self, s: ast.For, scope: _Scope) -> None:
        it = s.iter
        if not (
            isinstance(it, ast.Call)
            and isinstance(it.func, ast.Name)
            and it.func.id == "range"
            and 1 <= len(it.args) <= 3
            and not it.keywords
        ):
            raise self.err(s, "only `for <name> in range(...)` loops are traced", "loop over an index with range(n)")
        if s.orelse:
            raise self.err(s, "`for ... else` is not traced", "remove the else clause")
        if not isinstance(s.target, ast.Name):
            raise self.err(s, "the loop variable must be a plain name")
        range_args = [self.value_of(a, scope) for a in it.args]
        for a, expr in zip(range_args, it.args):
            self.check_control(a, s, "the loop's trip count", "use a trip count from self.hparams, the job's sizes or a constant",
                               expr)
        var = s.target.id
        body = Graph(f"loop@{s.lineno}")
        inner = _Scope(body, scope)
        inner.names.add(var)
        self.stmts(s.body, inner)
        free = [n for n in body.free_values() if n != var]
        written = body.written_values()
        node = Node(
            NodeKind.LOOP,
            var,
            inputs=[a for a in range_args if isinstance(a, str)] + [n for n in free if n not in range_args],
            outputs=written + ([var] if var not in written else []),
            args=range_args,
            body=body,
        )
        node.meta["carried"] = [n for n in free if n in written]
        self.emit(scope, node, s)

    def branch(
        self,
        test: ast.expr,
        then: Callable[[_Scope], Any],
        orelse: Callable[[_Scope], Any],
        scope: _Scope,
        at: ast.AST,
    ) -> Node:
        """Traces ``if test: <then> else: <orelse>`` as a branch region (the condition must be
        a control value)."""
        cond = self.value_of(test, scope)
        self.check_control(
            cond,
            at,
            "the condition",
            "branch on hyperparameters, step counters or the job's sizes only; compute both sides with "
            "torch.where, or move the decision inside a component method",
            test,
        )
        line = getattr(at, "lineno", 0)
        before = dict(self.maybe_undefined)
        regions = []
        for name, fill in ((f"if@{line}", then), (f"else@{line}", orelse)):
            g = Graph(name)
            self.maybe_undefined = dict(before)
            fill(_Scope(g, scope))
            regions.append(g)
        body, other = regions
        w1, w2 = body.written_values(), other.written_values()
        written = w1 + [n for n in w2 if n not in w1]
        self.maybe_undefined = dict(before)
        for n in written:
            if n.startswith("self.") and not (n in w1 and n in w2):
                self.state_value(n[5:], scope, at)  # the side that does not write it keeps the old value
        one_sided = [n for n in written if not (n in w1 and n in w2) and not scope.has(n)]
        free = [n for r in regions for n in r.free_values()]
        passthrough = [n for n in written if not (n in w1 and n in w2) and scope.has(n)]
        inputs = ([cond] if isinstance(cond, str) else []) + free + passthrough
        node = Node(
            NodeKind.BRANCH,
            cond,
            inputs=list(dict.fromkeys(inputs)),
            outputs=written,
            body=body,
            orelse=other,
        )
        for n in written:
            if n.startswith("self.") and n[5:] not in self.written:
                self.written.append(n[5:])
        self.emit(scope, node, at)
        for n in one_sided:
            self.maybe_undefined[n] = f"{self.file}:{line}"
        return node

    # -- expressions ------------------------------------------------------------------------
    def call(self, e: ast.Call, scope: _Scope, outputs: list[str], unpack: bool = False) -> Node:
        role, method = self.component_call(e)  # type: ignore[misc]
        args: list[Any] = []
        for a in e.args:
            if isinstance(a, ast.Starred):
                raise self.err(e, "*args in a component call is not traced", "pass arguments one by one")
            args.append(self.value_of(a, scope))
        kwargs: dict[str, Any] = {}
        for k in e.keywords:
            if k.arg is None:
                raise self.err(e, "**kwargs in a component call is not traced", "pass keyword arguments one by one")
            kwargs[k.arg] = self.value_of(k.value, scope)
        inputs: list[str] = []
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, str) and a not in inputs:
                inputs.append(a)
        node = Node(NodeKind.CALL, (role, method), inputs=inputs, outputs=list(outputs), args=args, kwargs=kwargs, unpack=unpack)
        return self.emit(scope, node, e)

    def value_of(self, e: ast.expr, scope: _Scope) -> str | Const:
        """Flattens ``e`` into nodes; returns the value name holding it (or a constant)."""
        if isinstance(e, ast.Constant):
            return Const(e.value)
        if isinstance(e, ast.Name) and scope.has(e.id):
            self.read(e.id, e)
            return e.id
        if self.component_call(e):
            role, method = self.component_call(e)  # type: ignore[misc]
            tmp = self.new_tmp(f"{role}_{method}")
            self.call(e, scope, [tmp])
            return tmp
        if self.helper_call(e):
            return self.inline_helper(e, scope)
        attr = _self_attr(e)
        if attr is not None and attr not in ROLES and not self.is_method(attr):
            return self.state_value(attr, scope, e)
        tmp = self.new_tmp()
        self.compute(e, scope, [tmp], e)
        return tmp

    def state_value(self, attr: str, scope: _Scope, at: ast.AST) -> str:
        name = state_name(attr)
        if not scope.has(name):
            top = scope.top()
            node = Node(NodeKind.STATE_IN, attr, outputs=[name])
            node.id = next(self.ids)
            node.meta.update(file=self.file, line=getattr(at, "lineno", 0))
            top.graph.insert(self.state_ins, node)
            top.names.add(name)
            self.state_ins += 1
        return name

    def compute(
        self, e: ast.expr, scope: _Scope, outputs: list[str], at: ast.AST, unpack: bool = False
    ) -> str:
        rewritten = _Rewriter(self, scope).visit(copy.deepcopy(e))
        inputs: list[str] = []
        for sub in ast.walk(rewritten):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load) and scope.has(sub.id):
                self.read(sub.id, at)
                if sub.id not in inputs:
                    inputs.append(sub.id)
            elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load) and sub.id in self.globals:
                self.check_global(sub.id, at)
        node = Node(NodeKind.COMPUTE, rewritten, inputs=inputs, outputs=list(outputs), unpack=unpack)
        self.emit(scope, node, at, impure=_impure_call(rewritten, set(inputs), self.globals))
        return outputs[0] if outputs else ""

    def inline_helper(self, e: ast.Call, scope: _Scope) -> str | Const:
        name = self.helper_call(e)
        assert name is not None
        if self.depth >= MAX_INLINE_DEPTH:
            raise self.err(e, f"trainer methods nest deeper than {MAX_INLINE_DEPTH} (recursion?)", "flatten the helpers")
        method = isinstance(e.func, ast.Attribute)  # self.helper(...), or a module function
        fn = getattr(self.cls, name) if method else self.module_function(name)
        funcdef, file = self.parse(fn)
        params = [a.arg for a in (funcdef.args.args[1:] if method else funcdef.args.args)]
        if funcdef.args.vararg or funcdef.args.kwarg or funcdef.args.kwonlyargs or funcdef.args.defaults:
            raise self.err(funcdef, f"helper {name} may only take plain positional parameters")
        if len(e.args) != len(params) or e.keywords:
            raise self.err(e, f"helper {name} takes {len(params)} positional arguments")
        k = next(self.inline)
        local = set(params)
        for sub in ast.walk(funcdef):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                local.add(sub.id)
        prefix = f"_{name}{k}_"
        renamed = _Renamer({n: prefix + n for n in local}).visit(funcdef)
        values = [self.value_of(a, scope) for a in e.args]
        outer_file, outer_globals = self.file, self.globals
        for p, v in zip(params, values):
            src = ast.Name(v, ast.Load()) if isinstance(v, str) else ast.Constant(v.value)
            self.compute(ast.copy_location(src, e), scope, [prefix + p], e)
        self.file, self.globals = file, fn.__globals__
        self.depth += 1
        try:
            body = list(renamed.body)
            ret = body.pop() if body and isinstance(body[-1], ast.Return) else None
            self.stmts(body, scope)
            result: str | Const = Const(None)
            if ret is not None and ret.value is not None:
                result = self.value_of(ret.value, scope)
        finally:
            self.depth -= 1
            self.file, self.globals = outer_file, outer_globals
        return result


class _Rewriter(ast.NodeTransformer):
    """Replaces component calls, helper calls and ``self.<attr>`` inside an expression by the
    value names the tracer emitted for them."""

    def __init__(self, tracer: _Tracer, scope: _Scope) -> None:
        self.t, self.scope = tracer, scope

    def visit_Call(self, e: ast.Call) -> ast.AST:
        if self.t.component_call(e) or self.t.helper_call(e):
            v = self.t.value_of(e, self.scope)
            return ast.copy_location(
                ast.Name(v, ast.Load()) if isinstance(v, str) else ast.Constant(v.value), e
            )
        return self.generic_visit(e)

    def visit_IfExp(self, e: ast.IfExp) -> ast.AST:
        if not (_has_call(self.t, e.body) or _has_call(self.t, e.orelse)):
            return self.generic_visit(e)  # pure on both sides: one compute, exact
        tmp = self.t.new_tmp("ifexp")

        def side(expr: ast.expr) -> Callable[[_Scope], None]:
            def fill(inner: _Scope) -> None:
                v = self.t.value_of(expr, inner)
                src = ast.Name(v, ast.Load()) if isinstance(v, str) else ast.Constant(v.value)
                self.t.compute(ast.copy_location(src, expr), inner, [tmp], expr)

            return fill

        self.t.branch(e.test, side(e.body), side(e.orelse), self.scope, e)
        return ast.copy_location(ast.Name(tmp, ast.Load()), e)

    def visit_BoolOp(self, e: ast.BoolOp) -> ast.AST:
        for operand in e.values[1:]:
            if _has_call(self.t, operand):
                op = "and" if isinstance(e.op, ast.And) else "or"
                raise self.t.err(
                    operand,
                    f"a component or trainer method is called in an operand of `{op}` that runs only sometimes",
                    "write an `if` statement on a control value",
                )
        return self.generic_visit(e)

    def visit_Attribute(self, e: ast.Attribute) -> ast.AST:
        attr = _self_attr(e)
        if attr is not None:
            if attr in ROLES:
                raise self.t.err(e, f"component self.{attr} is used as a value", f"call a method of self.{attr}")
            if self.t.is_method(attr):
                raise self.t.err(e, f"method self.{attr} is used as a value", "call it")
            return ast.copy_location(ast.Name(self.t.state_value(attr, self.scope, e), ast.Load()), e)
        return self.generic_visit(e)

    def visit_Name(self, e: ast.Name) -> ast.AST:
        if e.id == "self":
            raise self.t.err(e, "`self` is used as a value", "read trainer attributes as self.<attr>")
        return e

    def _no_calls(self, e: ast.AST, what: str) -> ast.AST:
        for sub in ast.walk(e):
            if self.t.component_call(sub) or self.t.helper_call(sub):
                raise self.t.err(
                    sub,
                    f"a component or trainer method is called inside a {what}",
                    "call it in a `for ... in range(...)` loop and collect results in a Buffer",
                )
            if _self_attr(sub) is not None:
                raise self.t.err(sub, f"self.<attr> is read inside a {what}", "read it into a local name first")
        return e

    def visit_Lambda(self, e: ast.Lambda) -> ast.AST:
        return self._no_calls(e, "lambda")

    def visit_ListComp(self, e: ast.AST) -> ast.AST:
        return self._no_calls(e, "comprehension")

    visit_SetComp = visit_DictComp = visit_GeneratorExp = visit_ListComp

    def visit_NamedExpr(self, e: ast.NamedExpr) -> ast.AST:
        raise self.t.err(e, "the walrus operator is not traced", "assign on its own line")

    def visit_Await(self, e: ast.Await) -> ast.AST:
        raise self.t.err(e, "await is not traced")

    def visit_Yield(self, e: ast.AST) -> ast.AST:
        raise self.t.err(e, "yield is not traced")

    visit_YieldFrom = visit_Yield


class _Renamer(ast.NodeTransformer):
    def __init__(self, mapping: dict[str, str]) -> None:
        self.mapping = mapping

    def visit_Name(self, e: ast.Name) -> ast.AST:
        if e.id in self.mapping:
            return ast.copy_location(ast.Name(self.mapping[e.id], e.ctx), e)
        return e


def _has_call(tracer: _Tracer, e: ast.AST) -> bool:
    """Whether ``e`` calls a component or trainer method anywhere inside."""
    return any(tracer.component_call(sub) or tracer.helper_call(sub) for sub in ast.walk(e))


def _impure_call(e: ast.AST, values: set[str], globals_: dict[str, Any] | None = None) -> str | None:
    """The first call in ``e`` that is not known deterministic (see :data:`PURE_CALLS`), as
    source text; ``None`` when every call is pure. NumPy's elementwise functions (ufuncs:
    ``np.floor``, ``np.clip`` is not one) are pure. Method calls on a traced value
    (``metrics.get(...)``) are judged by that value's kind, not here."""
    numpy = sys.modules.get("numpy")
    for sub in ast.walk(e):
        if not isinstance(sub, ast.Call):
            continue
        f = sub.func
        if isinstance(f, ast.Name) and f.id in PURE_CALLS:
            continue
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "math":
            continue
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in values:
            continue
        if (numpy is not None and isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                and (globals_ or {}).get(f.value.id) is numpy and isinstance(getattr(numpy, f.attr, None), numpy.ufunc)):
            continue
        return ast.unparse(f)
    return None


def _immutable(value: Any, depth: int = 0) -> bool:
    """Whether a module global is a constant: a number, string, bytes, ``None``, a module,
    function or class, an enum member, a torch dtype or device, a frozen dataclass, or a tuple
    or frozenset of those."""
    import enum
    import types

    import torch

    if isinstance(value, (bool, int, float, complex, str, bytes, type(None), range, types.ModuleType, types.FunctionType,
                          types.BuiltinFunctionType, types.MethodType, type, enum.Enum, torch.dtype, torch.device)):
        return True
    if callable(value) and not isinstance(value, (torch.nn.Module, torch.Tensor)):
        return True  # a function object of another kind (functools.partial, a ufunc)
    if isinstance(value, (tuple, frozenset)) and depth < 8:
        return all(_immutable(v, depth + 1) for v in value)
    params = getattr(type(value), "__dataclass_params__", None)
    return bool(params is not None and params.frozen)


def _rebound_globals(module_name: str) -> frozenset[str]:
    """Names that some function of module ``module_name`` declares ``global`` (and so may
    rebind while the job runs)."""
    import sys

    module = sys.modules.get(module_name)
    if module is None:
        return frozenset()
    cached = _REBOUND.get(module_name)
    if cached is not None:
        return cached
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError):
        names: frozenset[str] = frozenset()
    else:
        names = frozenset(n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names)
    _REBOUND[module_name] = names
    return names


_REBOUND: dict[str, frozenset[str]] = {}


def _self_attr(e: ast.AST) -> str | None:
    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
        return e.attr
    return None


def _as_load(t: ast.expr) -> ast.expr:
    """The load form of an assignment target (``x`` or ``self.x``)."""
    if isinstance(t, ast.Name):
        return ast.Name(t.id, ast.Load())
    assert isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
    return ast.Attribute(ast.Name(t.value.id, ast.Load()), t.attr, ast.Load())


def trace_methods(trainer_cls: type[Trainer], methods: tuple[str, ...] = TRACED_METHODS) -> dict[str, Graph]:
    """Builds the FDGs of several trainer methods together.

    Which trainer attributes are control state depends on every method that writes them, and
    which local names are data depends on writes later in a loop body, so the methods are
    traced until the set of data names stops growing. Each node's ``meta["control"]`` then
    says whether it computes control values only (``state_in``, ``compute``, ``state_out``).

    Args:
        trainer_cls: a :class:`~msrl.api.Trainer` subclass.
        methods: the methods to trace (those the class does not define trace as empty).

    Returns:
        method -> linted :class:`~msrl.graph.Graph`: ``state_in`` nodes first, the body in
        program order, ``state_out`` for every trainer attribute written, one ``output`` node.

    Raises:
        TraceError: code outside the supported subset, with ``file:line`` and advice.
        TypeError: ``trainer_cls`` is not a Trainer subclass, or a method's source is unreadable.
    """
    tainted: dict[str, set[str]] = {m: set() for m in methods}
    shared: set[str] = set()
    while True:
        tracers = {m: _Tracer(trainer_cls, tainted[m] | shared) for m in methods}
        graphs = {m: t.trace(m) for m, t in tracers.items()}
        grown = False
        for m, t in tracers.items():
            state = {n for n in t.tainted if n.startswith("self.")}
            if not t.tainted <= (tainted[m] | shared):
                grown = True
            tainted[m] |= t.tainted - state
            shared |= state
        if not grown:
            break
    for m, g in graphs.items():
        data = tainted[m] | shared
        for node in g.walk():
            if node.kind is NodeKind.STATE_IN:
                node.meta["control"] = node.outputs[0] not in data
            elif node.kind is NodeKind.COMPUTE:
                # a definition's own kind: the name it writes may hold data elsewhere
                # (``metrics = {}`` before ``metrics = self.learner.learn(...)``)
                node.meta["control"] = "impure" not in node.meta and not any(i in data for i in node.inputs)
            elif node.kind is NodeKind.STATE_OUT:
                node.meta["control"] = node.inputs[0] not in data
    return graphs


def trace(trainer_cls: type[Trainer], method: str = "train_step") -> Graph:
    """Builds the FDG of ``trainer_cls.<method>`` from its source (traced together with the
    other methods of :data:`TRACED_METHODS`, see :func:`trace_methods`).

    Args:
        trainer_cls: a :class:`~msrl.api.Trainer` subclass.
        method: ``"train_step"`` or ``"reset"`` (any method of the traced subset).

    Returns:
        a linted :class:`~msrl.graph.Graph` (see :func:`trace_methods`).

    Raises:
        TraceError: code outside the supported subset, with ``file:line`` and advice.
        TypeError: ``trainer_cls`` is not a Trainer subclass, or the method's source is unreadable.
    """
    methods = TRACED_METHODS if method in TRACED_METHODS else (method,)
    return trace_methods(trainer_cls, methods)[method]


def check_references(graphs: dict[str, Graph], trainer: Trainer) -> None:
    """Checks what the traced methods name against a built trainer: every component method
    called exists on its component, and every trainer attribute read is one the trainer has
    (from ``__init__``) or that ``reset()`` sets before ``train_step`` reads it -- so a typo
    (``self.buffer.gather_all()``, ``self.policy.act(obs)``) or state read before it is set
    (``self.count = self.count + 1`` with no initial value) is one error naming its line, not an
    ``AttributeError`` from generated code.

    Args:
        graphs: method -> traced graph.
        trainer: a trainer built with every component (the probe's, under ``single``).

    Raises:
        TraceError: naming the line, what is missing, and the closest names that exist.
    """
    import difflib

    written_in = {m: {n.target for n in g.walk() if n.kind is NodeKind.STATE_OUT} for m, g in graphs.items()}
    written = set().union(*written_in.values()) if written_in else set()
    components = trainer.components
    for method, g in graphs.items():
        for n in g.walk():
            where = (n.meta.get("file", "<unknown>"), n.meta.get("line", 0))
            if n.kind is NodeKind.CALL and n.role in components:
                comp, name = components[n.role], n.target[1]
                if not callable(getattr(comp, name, None)):
                    public = [m for m in dir(comp) if not m.startswith("_") and callable(getattr(comp, m, None))]
                    close = difflib.get_close_matches(name, public, n=3)
                    raise TraceError(*where, f"self.{n.role} ({type(comp).__name__}) has no method {name!r}",
                                     f"Did you mean {' or '.join(repr(c) for c in close)}?" if close
                                     else f"its methods: {', '.join(sorted(public))}")
            elif n.kind is NodeKind.STATE_IN and not hasattr(trainer, n.target):
                if method != "reset" and n.target in written_in.get("reset", set()):
                    continue  # reset() sets it before the first train_step
                if n.target in written:  # written, but only after this read
                    raise TraceError(*where, f"self.{n.target} is read before it is set: {method}() reads it here, and "
                                     "neither the trainer's __init__ nor reset() sets it",
                                     f"Set it in reset() (e.g. self.{n.target} = 0)")
                names = sorted(set(components) | written | {a for a in vars(trainer) if not a.startswith("_")})
                close = difflib.get_close_matches(n.target, names, n=3)
                raise TraceError(*where, f"self.{n.target} is neither a component of this trainer "
                                 f"({', '.join(f'self.{c}' for c in components)}) nor an attribute it has or writes",
                                 f"Did you mean {' or '.join(f'self.{c}' for c in close)}?" if close else "")
