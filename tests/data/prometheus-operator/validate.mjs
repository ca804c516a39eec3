// Reads a JSON list of monitoring.coreos.com/v1 objects on stdin and prints a JSON list of
// "Kind/name: error" lines (empty: all valid) against the schemas that
// @kubernetes-models/prometheus-operator (package.json beside this file) generates from
// prometheus-operator's CRDs. Run with the installed package's directory as cwd:
//   node --input-type=module -e "$(cat validate.mjs)"   (tests/helm_chart.py does so)
import { readFileSync } from "node:fs";
import { PodMonitor, PrometheusRule, ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1";

const kinds = { PodMonitor, PrometheusRule, ServiceMonitor };
const errors = [];
for (const obj of JSON.parse(readFileSync(0, "utf8"))) {
  const name = `${obj.kind}/${obj.metadata?.name}`;
  const Kind = kinds[obj.kind];
  if (!Kind || obj.apiVersion !== "monitoring.coreos.com/v1") {
    errors.push(`${name}: not a monitoring.coreos.com/v1 ${Object.keys(kinds).join("/")}`);
    continue;
  }
  try {
    new Kind(obj).validate();
  } catch (e) {
    errors.push(`${name}: ${e.message}`);
  }
}
console.log(JSON.stringify(errors));
