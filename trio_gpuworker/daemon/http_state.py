"""The read-only routes: probes, lanes, models and metrics, from cached state only (none waits on a worker).

- `/livez`: the event loop answers and the supervisor's tasks and listeners are alive. Workers being down,
  restarting or quarantined never fail it: restarting the daemon would not bring them back sooner.
- `/readyz`: every model a lane is configured for has a lane that can serve it now (`?model=ID`: that one).
  It fails first on SIGTERM, before the daemon stops admitting and before the listener closes.
- `/health` (and `GET /`): text-embeddings-inference's and vLLM's health check, in their shape: 200 with an empty
  body while `/readyz` would pass, else 503 with TEI's `{"error": "unhealthy", "error_type": "unhealthy"}`.
- `/healthz`: the lanes' states, 200 while any lane serves (as before /livez and /readyz existed); during a lane's
  first start its entry's `starting` says how far it is (phase spawn or load, the model, PROGRESS steps, seconds),
  and the status is `starting` until some lane serves. A lane whose LOAD of a model failed serves its other models,
  but its entry's `load_errors` names the model and why, and the status is `degraded`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..supervisor import SERVING_STATES
from .http_common import HttpError, Intake, Raw

if TYPE_CHECKING:
    from ..supervisor import Supervisor
    from .admin import LaneAdmin
    from .metrics import Metrics


def lane_status(sup: Supervisor, s: dict[str, Any]) -> dict[str, Any]:
    """A lane's status as /v1/lanes shows it: with the models it is configured for."""
    lane = sup.lanes.get(s["lane_id"])
    return {**s, "configured_models": list(lane.loads) if lane is not None else []}


class StateRoutes:
    def __init__(self, sup: Supervisor, admin: LaneAdmin, intake: Intake, metrics: Metrics | None,
                 liveness: Callable[[], tuple[bool, str]]) -> None:
        self.sup, self.admin, self.intake, self.metrics, self.liveness = sup, admin, intake, metrics, liveness

    async def healthz(self, _: dict[str, str], __: Any) -> tuple[int, Any]:
        """Cached lane state only: never waits on a worker."""
        lanes = [{k: s[k] for k in ("lane_id", "state", "pid", "generation", "strikes", "cooldown_remaining_s",
                                    "starting", "load_errors")} for s in self.sup.status()]
        serving = any(ln["state"] in SERVING_STATES for ln in lanes)
        healthy = all(ln["state"] in SERVING_STATES and not ln["load_errors"] for ln in lanes)
        starting = any(ln["starting"] is not None for ln in lanes)  # a lane's first start: phase, model, steps
        if not self.intake.admitting:
            return 503, {"status": "draining", "lanes": lanes}
        status = "ok" if healthy else "degraded" if serving else "starting" if starting else "unavailable"
        return (200 if serving else 503), {"status": status, "lanes": lanes}

    def _ready(self, models: list[str]) -> bool:
        router = self.sup.router
        return not self.intake.draining and bool(models) and all(router.ready_lanes(m) for m in models)

    async def health(self, _: dict[str, str], __: Any) -> tuple[int, Any] | Raw:
        if self._ready(self.sup.router.served_models()):
            return Raw(200, b"", "text/plain")
        return 503, {"error": "unhealthy", "error_type": "unhealthy"}

    async def livez(self, _: dict[str, str], __: Any) -> tuple[int, Any]:
        ok, why = self.liveness()
        return (200, {"status": "ok"}) if ok else (503, {"status": "unhealthy", "reason": why})

    async def readyz(self, params: dict[str, str], __: Any) -> tuple[int, Any]:
        one = params.get("model")
        if one is not None:
            self.sup.model_config(one)  # 404 for a model that is not configured
        router = self.sup.router
        models = {m: router.ready_lanes(m) for m in ([one] if one is not None else router.served_models())}
        body: dict[str, Any] = {"models": {m: {"ready": bool(lanes), "lanes": lanes} for m, lanes in models.items()}}
        if self.intake.draining:  # readiness has failed: SIGTERM was received
            return 503, {"status": "draining", **body}
        ready = bool(models) and all(models.values())  # a daemon serving no model is not ready
        return (200 if ready else 503), {"status": "ready" if ready else "not_ready", **body}

    async def prometheus(self, _: dict[str, str], __: Any) -> Raw:
        if self.metrics is None:
            raise HttpError(404, "not_found", "metrics are not enabled")
        from .metrics import CONTENT_TYPE

        return Raw(200, self.metrics.render(), CONTENT_TYPE)

    async def lanes(self, _: dict[str, str], __: Any) -> tuple[int, Any]:
        return 200, {"object": "list", "data": [lane_status(self.sup, s) for s in self.sup.status()]}

    async def lane(self, params: dict[str, str], _: Any) -> tuple[int, Any]:
        return 200, lane_status(self.sup, self.sup.lane_status(self.admin.lane(params["lane"])))

    async def _model_entry(self, model: str) -> dict[str, Any]:
        """OpenAI's model object, with vLLM's `max_model_len` and the daemon's kind and lanes."""
        m = self.sup.config.model(model)
        return {"id": m.id, "object": "model", "created": 0, "owned_by": "trio-gpuworker", "kind": m.kind,
                "max_model_len": await self.sup.model_len(m.id),
                "lanes": [ln.id for ln in self.sup.lanes.values() if m.id in ln.loads],
                "ready_lanes": [ln.id for ln in self.sup.lanes.values() if m.id in ln.models_loaded]}

    async def models(self, _: dict[str, str], __: Any) -> tuple[int, Any]:
        return 200, {"object": "list", "data": [await self._model_entry(m.id) for m in self.sup.config.models]}

    async def model(self, params: dict[str, str], __: Any) -> tuple[int, Any]:
        """GET /v1/models/{id}: one model object; ModelNotFound (404) for an id no model has."""
        return 200, await self._model_entry(params["model"])
