"""``lengthwise registry``: list versions, promote with the guard, move aliases, report online error."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("registry", help="inspect and promote registered length predictors")
    rs = p.add_subparsers(dest="registry_cmd", required=True)
    ls = rs.add_parser("list", help="versions of a registered model with their aliases, test metrics and target model",
                       description="One row per version: its aliases, test metrics, evaluation split, the model whose "
                                   "response lengths it predicts (its target: name@hash, 'unknown' for versions "
                                   "registered before targets were recorded) with the labels' cap, and its run.")
    ls.add_argument("--name", default="length-predictor")
    pr = rs.add_parser("promote", help="point an alias (default champion) at a version, guarded by its evaluation")
    pr.add_argument("version")
    pr.add_argument("--name", default="length-predictor")
    pr.add_argument("--alias", default="champion")
    pr.add_argument("--force", action="store_true", help="promote even if worse or evaluated on other data")
    rp = rs.add_parser("report", help="online prediction error of a version, from the sidecar's feedback windows in MLflow",
                       description="Print the online error windows (top-1 and within-one accuracy, MAE, bias, under-prediction, "
                                   "alarms) that predictor-sidecar logged for one model version, with their feedback-weighted "
                                   "total beside the version's offline test accuracy.")
    rp.add_argument("--name", default="length-predictor")
    which = rp.add_mutually_exclusive_group()
    which.add_argument("--version", help="a version number")
    which.add_argument("--alias", default="champion", help="the version an alias points at (default: %(default)s)")
    rp.add_argument("--last", type=int, default=20, metavar="N", help="show the last N windows (default: %(default)s)")
    return p


def dispatch(a: argparse.Namespace) -> int:
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException
    from rich.console import Console
    from rich.table import Table

    from registry import store

    store.configure()
    try:
        if a.registry_cmd == "list":
            client = MlflowClient()
            versions = client.search_model_versions(f"name='{a.name}'")
            aliases = {}
            for alias in client.get_registered_model(a.name).aliases:
                aliases.setdefault(str(client.get_model_version_by_alias(a.name, alias).version), []).append(alias)
            t = Table(title=f"{a.name} @ {store.tracking_uri()}")
            rows = []
            for v in sorted(versions, key=lambda v: int(v.version)):
                target = store.tags_target(v.tags) or {}
                rows.append((str(v.version), ", ".join(aliases.get(str(v.version), [])), v.tags.get("accuracy", ""),
                             v.tags.get("kendall_tau", ""), v.tags.get("mae_tokens", ""), v.tags.get(store.TAG_SPLIT, ""),
                             target.get("model") or "unknown", str(target.get("max_tokens") or ""), v.run_id or ""))
            t.add_column("version")
            # an alias cut to "cham…" is no answer to "which is champion": one alias a line if need be, never cut
            t.add_column("aliases", min_width=max([len(x) for names in aliases.values() for x in names] + [7]))
            for c in ("accuracy", "kendall_tau", "mae_tokens", "eval_split"):
                t.add_column(c)
            # the target model is what an operator matches against the served model: never cut; the run id may fold
            t.add_column("target_model", no_wrap=True, min_width=max([len(r[6]) for r in rows] + [12]))
            t.add_column("label_max_tokens")
            t.add_column("run", overflow="fold")
            for r in rows:
                t.add_row(*r)
            Console(width=max(Console().width, 160)).print(t)
        elif a.registry_cmd == "promote":
            print(store.promote(a.name, a.version, a.alias, a.force))
        elif a.registry_cmd == "report":
            from registry.report import print_report

            print_report(a.name, a.version, a.alias, a.last)
    except store.PromotionRefused as exc:
        print(f"lengthwise registry: refused: {exc}", file=sys.stderr)
        return 2
    except MlflowException as exc:
        print(f"lengthwise registry: error: {exc.message.splitlines()[0]}", file=sys.stderr)
        return 2
    return 0
