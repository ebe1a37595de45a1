// Validate custom resources with their project's own schema, as an npm package ships it:
// @kubernetes-models/prometheus-operator (monitoring.coreos.com/v1, generated from the
// prometheus-operator's Go API types) for PodMonitor, ServiceMonitor and PrometheusRule.
//
//   node crd_validate.mjs INSTALL_DIR < documents.json > findings.json
//
// INSTALL_DIR holds node_modules/ (tests/helm/crd_schemas.py installs it into .cache/npm).
// stdin: a JSON list of objects; stdout: one entry per object, {"errors": [...], "unknown":
// [...]}. "errors" are the schema's findings (types, enums, patterns, required fields);
// "unknown" the fields the schema never looked at, which an API server with strict field
// validation (kubectl --validate=strict) refuses: the validator reads every property it knows,
// so a property it never read is one the type does not have.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const root = process.argv[2];
const models = join(root, "node_modules", "@kubernetes-models", "prometheus-operator");
const KINDS = ["PodMonitor", "ServiceMonitor", "PrometheusRule"];
const classes = {};
for (const kind of KINDS) {
  const file = join(models, "monitoring.coreos.com", "v1", `${kind}.js`);
  classes[kind] = (await import(pathToFileURL(file).href))[kind];
}

function watched(value, path, read) {
  if (value === null || typeof value !== "object") return value;
  return new Proxy(value, {
    get(target, key, receiver) {
      const found = Reflect.get(target, key, receiver);
      if (typeof key !== "string" || !Object.hasOwn(target, key)) return found;
      read.add(`${path}/${key}`);
      return watched(found, `${path}/${key}`, read);
    },
  });
}

function fields(value, path, out) {
  if (value === null || typeof value !== "object") return out;
  for (const [key, inner] of Object.entries(value)) {
    out.push(`${path}/${key}`);
    fields(inner, `${path}/${key}`, out);
  }
  return out;
}

const findings = [];
for (const doc of JSON.parse(readFileSync(0, "utf8"))) {
  const model = classes[doc.kind];
  if (model === undefined) {
    findings.push({ errors: [`no schema here for kind ${doc.kind}`], unknown: [] });
    continue;
  }
  const read = new Set();
  const errors = [];
  try {
    model.prototype.validate.call(watched(doc, "", read));
  } catch (error) {
    errors.push(...String(error.message).split(", "));
  }
  findings.push({ errors, unknown: fields(doc, "", []).filter((path) => !read.has(path)) });
}
process.stdout.write(JSON.stringify(findings));
