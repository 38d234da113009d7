"""Rules of ops that compute no values from their operands: shape queries, constants,
variable reads and writes, stateless random draws, no-ops and IdentityN.

In:  such an :class:`tapas.ir.OpInfo` and its :class:`~tapas.sharding.rules.spec.OpContext`.
Out: its :class:`~tapas.sharding.rules.spec.OpSpec`. A shape query reads only the static
     shape of its operand, which may be placed anyhow (``meta_any``); on a split operand it
     needs the ``global-shape`` rewrite (``global_shape``). Constants have no data operands;
     a variable read and IdentityN pass placements through. A stateless random draw
     (dropout's mask in training mode) reads only meta operands (shape, key, counter,
     algorithm) and yields its *global* value, replicated: consumers that split it slice
     it locally, so every device sees the single-device draw (``tapas.execution.program.stateful``).
     A variable write (``AssignVariableOp``: a Keras seed generator's state, batch norm's
     moving statistics) needs its value whole on every device and the variable replicated.

This module imports no TensorFlow.
"""

from __future__ import annotations

from tapas.ir import OpInfo
from tapas.sharding.rules.spec import Fresh, OpContext, OpSpec, rank

SHAPE_QUERY = ("Shape", "Size", "Rank")
CONSTANT = ("Const", "Range", "Fill", "LinSpace", "BroadcastArgs")
# stateless random ops (Keras's random ops on TensorFlow): every operand is meta
RANDOM = ("StatelessRandomUniformV2", "StatelessRandomNormalV2", "StatelessTruncatedNormalV2",
          "StatelessRandomUniformIntV2", "StatelessRandomUniformFullIntV2",
          "StatelessRandomGetKeyCounter", "StatelessRandomGetKeyCounterAlg",
          "StatelessRandomUniform", "StatelessRandomNormal", "StatelessTruncatedNormal",
          "StatelessRandomUniformInt", "StatelessRandomUniformFullInt")
# stateful random ops (Keras 2's Dropout, tf.random.* without a seed): reconstruction draws
# them statelessly with the traced shape, the same on every device, so the rule is the same
STATEFUL_RANDOM = ("RandomUniform", "RandomStandardNormal", "TruncatedNormal",
                   "RandomUniformInt")
VARIABLE_WRITES = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")


def shape_query(op: OpInfo, ctx: OpContext) -> OpSpec:
    return OpSpec((None,), (Fresh().many(rank(ctx.out_shapes[0])),), meta_any=True,
                  flops="none", global_shape=True)


def shape_n(op: OpInfo, ctx: OpContext) -> OpSpec:
    fresh = Fresh()
    return OpSpec(tuple(None for _ in op.inputs),
                  tuple(fresh.many(rank(s)) for s in ctx.out_shapes), meta_any=True,
                  flops="none", global_shape=True)


def constant(op: OpInfo, ctx: OpContext) -> OpSpec:
    fresh = Fresh()
    return OpSpec(tuple(None for _ in op.inputs),
                  tuple(None if s is None else fresh.many(len(s)) for s in ctx.out_shapes),
                  flops="none")


def random(op: OpInfo, ctx: OpContext) -> OpSpec:
    """A random draw (stateless, or stateful and drawn statelessly by reconstruction): meta
    operands only, the output replicated (the global draw), sliced locally by consumers
    that split it."""
    return OpSpec(tuple(None for _ in op.inputs),
                  tuple(None for _ in ctx.out_shapes), flops="none")


def variable_write(op: OpInfo, ctx: OpContext) -> OpSpec:
    """``Assign*VariableOp(resource, value)``: the variable replicated (a meta operand) and
    the value whole (its axes may not be split; a partial value is all-reduced first)."""
    labs = Fresh().many(rank(ctx.in_shapes[1]) if len(ctx.in_shapes) > 1 else 0)
    return OpSpec((None, labs), (), no_split=frozenset(labs), flops="none")


def no_op(op: OpInfo, ctx: OpContext) -> OpSpec:
    return OpSpec(tuple(None for _ in op.inputs), (), flops="none")


def read_variable(op: OpInfo, ctx: OpContext) -> OpSpec:
    xl = Fresh().many(rank(ctx.out_shapes[0]))
    return OpSpec((xl,), (xl,), linear=(0,), flops="none")


def identity_n(op: OpInfo, ctx: OpContext) -> OpSpec:
    """Output i is input i: linear in each, no mixing between them."""
    fresh = Fresh()
    labs = tuple(fresh.many(rank(s)) for s in ctx.in_shapes)
    return OpSpec(labs, labs, linear=tuple(range(len(labs))), flops="none")
