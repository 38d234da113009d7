"""Re-export of :mod:`tapas.sharding.gradients` for the modules that still import it here.

In:  nothing. Out: the names of ``tapas.sharding.gradients``. Import from there instead;
this module goes once ``tapas.execution.verify`` does.
"""

from tapas.sharding.gradients import NO_GRADIENT, NONE_GRADIENT, GradientFlow, differentiable, gradient_flow

__all__ = ["GradientFlow", "gradient_flow", "differentiable", "NO_GRADIENT", "NONE_GRADIENT"]
