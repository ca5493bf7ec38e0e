// Package deploytest checks the deployment files under deploy/compose and
// deploy/kubernetes: a broken file (bad YAML, a dangling reference, a
// setting the ledger has no flag for) fails `go test ./...` instead of an
// operator's first deploy. The package holds tests only.
package deploytest

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"

	"gopkg.in/yaml.v3"
)

// flagSource answers which flags a ledger command has. The real one reads
// the binary's --help; the table tests use a fixed one.
type flagSource interface {
	// Flags returns the flags (without dashes) of `ledger <path...>`,
	// inherited ones included, or an error if there is no such command.
	Flags(path []string) (map[string]bool, error)
	// All returns the union of the flags of every role the deployment
	// files run: what a ConfigMap shared by the roles may name.
	All() (map[string]bool, error)
}

// roleCommands are the commands the deployment files run.
var roleCommands = [][]string{
	{"intake"}, {"executor"}, {"reconciler"}, {"projector"}, {"projector", "migrate"},
	{"api"}, {"approvals", "serve"}, {"topics", "create"}, {"migrate"},
}

// helpFlags reads flags from `ledger <cmd> --help`, once per command.
type helpFlags struct {
	bin   string
	mu    sync.Mutex
	cache map[string]helpResult
}

type helpResult struct {
	flags map[string]bool
	err   error
}

// flagRE matches a flag at the start of a help line: "  -h, --help" or
// "      --kafka-brokers strings".
var flagRE = regexp.MustCompile(`^\s+(?:-[a-zA-Z], )?--([a-z0-9][a-z0-9-]*)`)

func newHelpFlags(bin string) *helpFlags {
	return &helpFlags{bin: bin, cache: map[string]helpResult{}}
}

func (h *helpFlags) Flags(path []string) (map[string]bool, error) {
	key := strings.Join(path, " ")
	h.mu.Lock()
	defer h.mu.Unlock()
	if r, ok := h.cache[key]; ok {
		return r.flags, r.err
	}
	flags, err := h.run(path)
	h.cache[key] = helpResult{flags, err}
	return flags, err
}

func (h *helpFlags) run(path []string) (map[string]bool, error) {
	var out, errb bytes.Buffer
	cmd := exec.Command(h.bin, append(append([]string{}, path...), "--help")...)
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("ledger %s --help: %w: %s", strings.Join(path, " "), err, errb.String())
	}
	return parseHelp(path, out.String())
}

// parseHelp extracts the flags from cobra's help text, after checking that
// the text is the help of the command asked for (cobra prints a parent's
// help for an unknown subcommand).
func parseHelp(path []string, help string) (map[string]bool, error) {
	lines := strings.Split(help, "\n")
	usage := ""
	for i, l := range lines {
		if strings.TrimSpace(l) == "Usage:" && i+1 < len(lines) {
			usage = strings.TrimSpace(lines[i+1])
			break
		}
	}
	want := strings.Join(append([]string{"ledger"}, path...), " ")
	if usage != want && !strings.HasPrefix(usage, want+" ") {
		return nil, fmt.Errorf("no command %q: its help's usage line is %q", want, usage)
	}
	flags := map[string]bool{}
	inFlags := false
	for _, l := range lines {
		t := strings.TrimSpace(l)
		if t == "Flags:" || t == "Global Flags:" {
			inFlags = true
			continue
		}
		if !inFlags {
			continue
		}
		if m := flagRE.FindStringSubmatch(l); m != nil {
			flags[m[1]] = true
		}
	}
	if len(flags) == 0 {
		return nil, fmt.Errorf("%s --help lists no flags", want)
	}
	return flags, nil
}

func (h *helpFlags) All() (map[string]bool, error) {
	all := map[string]bool{}
	for _, p := range roleCommands {
		fs, err := h.Flags(p)
		if err != nil {
			return nil, err
		}
		for f := range fs {
			all[f] = true
		}
	}
	return all, nil
}

// parseDocs decodes every YAML document of data; empty documents are
// dropped. Anchors and merge keys are resolved.
func parseDocs(data []byte) ([]map[string]any, error) {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var docs []map[string]any
	for i := 0; ; i++ {
		var v any
		err := dec.Decode(&v)
		if errors.Is(err, io.EOF) {
			return docs, nil
		}
		if err != nil {
			return nil, fmt.Errorf("document %d: %w", i+1, err)
		}
		if v == nil {
			continue
		}
		m, ok := v.(map[string]any)
		if !ok {
			return nil, fmt.Errorf("document %d: top level is %T, not a mapping", i+1, v)
		}
		docs = append(docs, m)
	}
}

// Small accessors over decoded YAML; a missing or mistyped value reads as
// the zero value, and the checks report it.

func mapOf(v any) map[string]any {
	m, _ := v.(map[string]any)
	return m
}

func listOf(v any) []any {
	l, _ := v.([]any)
	return l
}

func strOf(v any) string {
	s, _ := v.(string)
	return s
}

func dig(v any, keys ...string) any {
	for _, k := range keys {
		v = mapOf(v)[k]
	}
	return v
}

func strList(v any) []string {
	var out []string
	for _, x := range listOf(v) {
		out = append(out, fmt.Sprint(x))
	}
	return out
}

// commandPath is the ledger subcommand of an argument list: its leading
// words up to the first flag ("projector", "migrate" of
// ["projector", "migrate", "--x"]). A leading binary path is dropped.
func commandPath(args []string) []string {
	if len(args) > 0 && strings.Contains(args[0], "/") {
		args = args[1:]
	}
	var p []string
	for _, a := range args {
		if strings.HasPrefix(a, "-") {
			break
		}
		p = append(p, a)
	}
	return p
}

// envFlag maps LEDGER_KAFKA_BROKERS to kafka-brokers; ok is false for a
// variable that is not the ledger's.
func envFlag(name string) (string, bool) {
	rest, ok := strings.CutPrefix(name, "LEDGER_")
	if !ok {
		return "", false
	}
	return strings.ReplaceAll(strings.ToLower(rest), "_", "-"), true
}

// checkEnv reports every LEDGER_* name that is not a flag of the command
// path runs (or, with path empty, of any role).
func checkEnv(where string, names []string, path []string, fs flagSource) []string {
	var flags map[string]bool
	var err error
	if len(path) == 0 {
		flags, err = fs.All()
	} else {
		flags, err = fs.Flags(path)
	}
	if err != nil {
		return []string{fmt.Sprintf("%s: %v", where, err)}
	}
	var probs []string
	for _, n := range names {
		f, ok := envFlag(n)
		if !ok {
			continue
		}
		if !flags[f] {
			cmd := "any ledger role"
			if len(path) > 0 {
				cmd = "ledger " + strings.Join(path, " ")
			}
			probs = append(probs, fmt.Sprintf("%s: %s names no flag of %s (no --%s)", where, n, cmd, f))
		}
	}
	return probs
}

// checkPolicies reports a role that decides calls (its command has
// --policy-versions-dir: intake, executor, reconciler) without the
// policies to decide with: no LEDGER_POLICY_VERSIONS_DIR, where a policy
// version activated on the control topic is loaded from (without it the
// activation denies every call of the role and fails its /readyz), or no
// LEDGER_POLICY_DIR on a read-only mount (the built-in demo policies
// otherwise). env is the container's environment, mounts its read-only
// mount paths; versionsMounted asks the versions directory to be one of
// them too (Compose; on Kubernetes each version is a mount of its own
// under it).
func checkPolicies(where string, path []string, env map[string]string, mounts map[string]bool, versionsMounted bool, fs flagSource) []string {
	flags, err := fs.Flags(path)
	if err != nil || !flags["policy-versions-dir"] {
		return nil
	}
	var probs []string
	role := "ledger " + strings.Join(path, " ")
	if dir := env["LEDGER_POLICY_VERSIONS_DIR"]; dir == "" {
		probs = append(probs, fmt.Sprintf("%s: %s decides calls but sets no LEDGER_POLICY_VERSIONS_DIR: a policy version activated on the control topic would deny its every call", where, role))
	} else if versionsMounted && !mounts[dir] {
		probs = append(probs, fmt.Sprintf("%s: LEDGER_POLICY_VERSIONS_DIR %q is not a read-only mount", where, dir))
	}
	if dir := env["LEDGER_POLICY_DIR"]; dir == "" {
		probs = append(probs, fmt.Sprintf("%s: %s decides calls but sets no LEDGER_POLICY_DIR: it would decide with the built-in demo policies", where, role))
	} else if !mounts[dir] {
		probs = append(probs, fmt.Sprintf("%s: LEDGER_POLICY_DIR %q is not a read-only mount", where, dir))
	}
	return probs
}

// --- Compose ----------------------------------------------------------------

// composeTopLevel are the top-level keys of the Compose spec.
var composeTopLevel = map[string]bool{
	"version": true, "name": true, "services": true, "networks": true,
	"volumes": true, "configs": true, "secrets": true, "include": true,
}

var dependsConditions = map[string]bool{
	"service_started": true, "service_healthy": true, "service_completed_successfully": true,
}

// ledgerImage is the image the ledger's services run.
const ledgerImage = "ghcr.io/toolcall-ledger/ledger"

// validateCompose checks one Compose file's document.
func validateCompose(doc map[string]any, fs flagSource) []string {
	var probs []string
	add := func(format string, a ...any) { probs = append(probs, fmt.Sprintf(format, a...)) }
	for k := range doc {
		if !composeTopLevel[k] && !strings.HasPrefix(k, "x-") {
			add("unknown top-level key %q", k)
		}
	}
	services := mapOf(doc["services"])
	if len(services) == 0 {
		add("no services (top-level key services is required)")
		return probs
	}
	volumes := mapOf(doc["volumes"])
	names := sortedKeys(services)

	// Services something waits for to complete are jobs; so is a service
	// that is never restarted.
	jobs := map[string]bool{}
	deps := map[string]map[string]string{}
	for _, name := range names {
		svc := mapOf(services[name])
		deps[name] = dependsOn(svc["depends_on"])
		for t, cond := range deps[name] {
			if cond == "service_completed_successfully" {
				jobs[t] = true
			}
		}
		if strOf(svc["restart"]) == "no" {
			jobs[name] = true
		}
	}

	instanceIDs := map[string]string{}
	for _, name := range names {
		svc := mapOf(services[name])
		where := "service " + name
		if svc == nil {
			add("%s: not a mapping", where)
			continue
		}
		image := strOf(svc["image"])
		if image == "" && svc["build"] == nil {
			add("%s: neither image nor build", where)
		}
		for t, cond := range deps[name] {
			if _, ok := services[t]; !ok {
				add("%s: depends_on %q, which is not a service", where, t)
				continue
			}
			if !dependsConditions[cond] {
				add("%s: depends_on %q with unknown condition %q", where, t, cond)
			}
			if cond == "service_healthy" && dig(services[t], "healthcheck", "test") == nil {
				add("%s: waits for %q to be healthy, but it has no healthcheck", where, t)
			}
		}
		if !jobs[name] {
			hc := mapOf(svc["healthcheck"])
			if hc == nil || hc["test"] == nil || hc["disable"] == true {
				add("%s: long-running service without a healthcheck", where)
			}
		}
		env := composeEnv(svc["environment"])
		var path []string
		isLedger := strings.HasPrefix(image, ledgerImage) || image == "" && svc["build"] != nil
		if isLedger {
			path = commandPath(commandArgs(svc["command"]))
			if len(path) == 0 {
				add("%s: runs the ledger image without a command (a role)", where)
			}
		}
		probs = append(probs, checkEnv(where, sortedKeys(env), path, fs)...)
		if isLedger && len(path) > 0 {
			if id, ok := env["LEDGER_INSTANCE_ID"]; ok {
				key := strings.Join(path, " ") + "\x00" + id
				if other, dup := instanceIDs[key]; dup {
					add("%s: LEDGER_INSTANCE_ID %q is also %s's: the two would fence each other's transactions", where, id, other)
				}
				instanceIDs[key] = name
			}
		}
		readOnly := map[string]bool{}
		for _, v := range listOf(svc["volumes"]) {
			src, _, ok := strings.Cut(fmt.Sprint(v), ":")
			if parts := strings.Split(fmt.Sprint(v), ":"); len(parts) == 3 && slices.Contains(strings.Split(parts[2], ","), "ro") {
				readOnly[parts[1]] = true
			}
			if m := mapOf(v); m != nil {
				src, ok = strOf(m["source"]), strOf(m["type"]) == "volume"
				if m["read_only"] == true {
					readOnly[strOf(m["target"])] = true
				}
			}
			if !ok || src == "" || strings.HasPrefix(src, ".") || strings.HasPrefix(src, "/") || strings.HasPrefix(src, "~") {
				continue
			}
			if _, declared := volumes[src]; !declared {
				add("%s: named volume %q is not declared under volumes", where, src)
			}
		}
		if isLedger && len(path) > 0 {
			probs = append(probs, checkPolicies(where, path, env, readOnly, true, fs)...)
		}
	}
	return probs
}

// dependsOn reads depends_on in its list or its map form.
func dependsOn(v any) map[string]string {
	out := map[string]string{}
	for _, x := range listOf(v) {
		out[fmt.Sprint(x)] = "service_started"
	}
	for k, x := range mapOf(v) {
		cond := strOf(mapOf(x)["condition"])
		if cond == "" {
			cond = "service_started"
		}
		out[k] = cond
	}
	return out
}

// composeEnv reads environment in its map or its list ("K=V") form.
func composeEnv(v any) map[string]string {
	out := map[string]string{}
	for k, x := range mapOf(v) {
		out[k] = fmt.Sprint(x)
	}
	for _, x := range listOf(v) {
		k, val, _ := strings.Cut(fmt.Sprint(x), "=")
		out[k] = val
	}
	return out
}

// commandArgs reads command as a list, or splits it as a string.
func commandArgs(v any) []string {
	if s, ok := v.(string); ok {
		return strings.Fields(s)
	}
	return strList(v)
}

func sortedKeys[V any](m map[string]V) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

// --- Kubernetes -------------------------------------------------------------

// kubeDoc is one manifest document and the file it came from.
type kubeDoc struct {
	file string
	doc  map[string]any
}

// knownKinds are the kinds the manifests may use, with their apiVersion.
var knownKinds = map[string]string{
	"Namespace": "v1", "ConfigMap": "v1", "Secret": "v1", "Service": "v1",
	"Deployment": "apps/v1", "StatefulSet": "apps/v1", "Job": "batch/v1",
	"PodDisruptionBudget": "policy/v1", "Issuer": "cert-manager.io/v1", "Certificate": "cert-manager.io/v1",
}

func (d kubeDoc) where() string {
	return fmt.Sprintf("%s: %s/%s", d.file, strOf(d.doc["kind"]), strOf(dig(d.doc, "metadata", "name")))
}

// validateKube checks a set of manifests as a whole: each document, and
// the references between them.
func validateKube(docs []kubeDoc, fs flagSource) []string {
	var probs []string
	add := func(format string, a ...any) { probs = append(probs, fmt.Sprintf(format, a...)) }
	byKind := map[string]map[string]kubeDoc{}
	for _, d := range docs {
		kind, api := strOf(d.doc["kind"]), strOf(d.doc["apiVersion"])
		name := strOf(dig(d.doc, "metadata", "name"))
		if kind == "" || api == "" || name == "" {
			add("%s: apiVersion, kind and metadata.name are all required", d.where())
			continue
		}
		want, ok := knownKinds[kind]
		if !ok {
			add("%s: unknown kind %q", d.where(), kind)
			continue
		}
		if api != want {
			add("%s: apiVersion %q, want %q", d.where(), api, want)
		}
		if byKind[kind] == nil {
			byKind[kind] = map[string]kubeDoc{}
		}
		if _, dup := byKind[kind][name]; dup {
			add("%s: defined twice", d.where())
		}
		byKind[kind][name] = d
	}
	// cert-manager writes each Certificate's Secret: it is in the set
	// for the pods that mount it.
	for _, name := range sortedKeys(byKind["Certificate"]) {
		d := byKind["Certificate"][name]
		secret := strOf(dig(d.doc, "spec", "secretName"))
		if secret == "" {
			add("%s: no spec.secretName", d.where())
			continue
		}
		if other, dup := byKind["Secret"][secret]; dup {
			add("%s: its Secret %q is also %s", d.where(), secret, other.where())
			continue
		}
		if byKind["Secret"] == nil {
			byKind["Secret"] = map[string]kubeDoc{}
		}
		byKind["Secret"][secret] = kubeDoc{file: d.file, doc: map[string]any{
			"apiVersion": "v1", "kind": "Secret",
			"metadata": map[string]any{"name": secret, "namespace": dig(d.doc, "metadata", "namespace")},
		}}
	}
	for _, d := range docs {
		kind := strOf(d.doc["kind"])
		if kind == "" || kind == "Namespace" || knownKinds[kind] == "" {
			continue
		}
		if ns := strOf(dig(d.doc, "metadata", "namespace")); ns == "" {
			add("%s: no metadata.namespace", d.where())
		} else if _, ok := byKind["Namespace"][ns]; !ok {
			add("%s: namespace %q is not in the set", d.where(), ns)
		}
	}

	// Workloads: template labels, for PDBs and Services to select.
	type workload struct {
		d      kubeDoc
		labels map[string]any
	}
	var workloads []workload
	for _, kind := range []string{"Deployment", "StatefulSet", "Job"} {
		for _, name := range sortedKeys(byKind[kind]) {
			d := byKind[kind][name]
			spec := mapOf(d.doc["spec"])
			labels := mapOf(dig(spec, "template", "metadata", "labels"))
			longRunning := kind != "Job"
			if longRunning {
				sel := mapOf(dig(spec, "selector", "matchLabels"))
				if len(sel) == 0 {
					add("%s: no spec.selector.matchLabels", d.where())
				} else if !labelsMatch(sel, labels) {
					add("%s: selector %v does not match the template's labels %v", d.where(), sel, labels)
				}
				workloads = append(workloads, workload{d, labels})
			}
			if kind == "StatefulSet" {
				if svc := strOf(spec["serviceName"]); svc == "" {
					add("%s: no serviceName", d.where())
				} else if _, ok := byKind["Service"][svc]; !ok {
					add("%s: serviceName %q is not a Service in the set", d.where(), svc)
				}
			}
			replicas := 1
			if r, ok := spec["replicas"].(int); ok {
				replicas = r
			}
			probs = append(probs, checkPod(d, mapOf(dig(spec, "template", "spec")), longRunning, replicas, byKind, fs)...)
		}
	}
	selects := func(sel map[string]any) bool {
		for _, w := range workloads {
			if labelsMatch(sel, w.labels) {
				return true
			}
		}
		return false
	}
	for _, name := range sortedKeys(byKind["PodDisruptionBudget"]) {
		d := byKind["PodDisruptionBudget"][name]
		sel := mapOf(dig(d.doc, "spec", "selector", "matchLabels"))
		if len(sel) == 0 || !selects(sel) {
			add("%s: selector %v matches no Deployment or StatefulSet", d.where(), sel)
		}
	}
	for _, name := range sortedKeys(byKind["Service"]) {
		d := byKind["Service"][name]
		sel := mapOf(dig(d.doc, "spec", "selector"))
		if len(sel) == 0 || !selects(sel) {
			add("%s: selector %v matches no Deployment or StatefulSet", d.where(), sel)
		}
	}
	for _, kind := range []string{"ConfigMap", "Secret"} {
		for _, name := range sortedKeys(byKind[kind]) {
			d := byKind[kind][name]
			var keys []string
			for _, field := range []string{"data", "stringData"} {
				keys = append(keys, sortedKeys(mapOf(d.doc[field]))...)
			}
			probs = append(probs, checkEnv(d.where(), keys, nil, fs)...)
		}
	}
	probs = append(probs, checkHTTPS(byKind, fs)...)
	probs = append(probs, checkQuestionsOnlyAtTheAPI(byKind)...)
	return probs
}

// checkQuestionsOnlyAtTheAPI checks that no projector serves the
// responders' questions: with an issuer it would, on its metrics port,
// beside the api's (which the set's clients and bounds are for).
func checkQuestionsOnlyAtTheAPI(byKind map[string]map[string]kubeDoc) []string {
	var probs []string
	for _, r := range ledgerRoles(byKind) {
		if strings.Join(r.path, " ") == "projector" && r.env["LEDGER_ISSUER"] != "" {
			probs = append(probs, fmt.Sprintf("%s: LEDGER_ISSUER is %q: the projector would serve the responders' questions on its metrics port; set it empty", r.where, r.env["LEDGER_ISSUER"]))
		}
	}
	return probs
}

func labelsMatch(sel, labels map[string]any) bool {
	for k, v := range sel {
		if fmt.Sprint(labels[k]) != fmt.Sprint(v) || labels[k] == nil {
			return false
		}
	}
	return true
}

// checkPod checks a pod template: containers' probes, resources and
// security, and the ConfigMaps and Secrets it refers to.
func checkPod(d kubeDoc, pod map[string]any, longRunning bool, replicas int, byKind map[string]map[string]kubeDoc, fs flagSource) []string {
	var probs []string
	add := func(format string, a ...any) { probs = append(probs, fmt.Sprintf(format, a...)) }
	if pod == nil {
		return []string{d.where() + ": no pod template spec"}
	}
	if dig(pod, "securityContext", "runAsNonRoot") != true {
		add("%s: pod securityContext.runAsNonRoot is not true", d.where())
	}
	if dig(pod, "securityContext", "fsGroup") != nil && dig(pod, "securityContext", "fsGroupChangePolicy") != "OnRootMismatch" {
		// Always, the default, chmods every file at each mount: key
		// files kept 0600 on a volume become group-readable, and the
		// role refuses them at its next start.
		add("%s: pod securityContext sets fsGroup without fsGroupChangePolicy: OnRootMismatch", d.where())
	}
	exists := func(kind, name, what string) {
		if _, ok := byKind[kind][name]; !ok {
			add("%s: %s refers to %s %q, which is not in the set", d.where(), what, kind, name)
		}
	}
	for _, v := range listOf(pod["volumes"]) {
		if n := strOf(dig(v, "configMap", "name")); n != "" {
			exists("ConfigMap", n, "volume")
		}
		if n := strOf(dig(v, "secret", "secretName")); n != "" {
			exists("Secret", n, "volume")
		}
	}
	containers := listOf(pod["containers"])
	if len(containers) == 0 {
		add("%s: no containers", d.where())
	}
	check := func(c any, init bool) {
		where := fmt.Sprintf("%s container %s", d.where(), strOf(dig(c, "name")))
		for _, res := range []string{"requests", "limits"} {
			for _, r := range []string{"cpu", "memory"} {
				if dig(c, "resources", res, r) == nil {
					add("%s: no resources.%s.%s", where, res, r)
				}
			}
		}
		if dig(c, "securityContext", "readOnlyRootFilesystem") != true {
			add("%s: securityContext.readOnlyRootFilesystem is not true", where)
		}
		if dig(c, "securityContext", "allowPrivilegeEscalation") != false {
			add("%s: securityContext.allowPrivilegeEscalation is not false", where)
		}
		ports := map[string]bool{}
		for _, p := range listOf(dig(c, "ports")) {
			if n := strOf(dig(p, "name")); n != "" {
				ports[n] = true
			}
			ports[fmt.Sprint(dig(p, "containerPort"))] = true
		}
		if longRunning && !init {
			// A startup probe too: without it, liveness kills a role
			// that migrates the store before it serves.
			for _, probe := range []string{"readinessProbe", "livenessProbe", "startupProbe"} {
				p := mapOf(dig(c, probe))
				var handlers []string
				for _, h := range []string{"httpGet", "tcpSocket", "exec", "grpc"} {
					if p[h] != nil {
						handlers = append(handlers, h)
					}
				}
				if len(handlers) != 1 {
					add("%s: %s needs exactly one handler, has %v", where, probe, handlers)
					continue
				}
				if port := dig(p, handlers[0], "port"); (handlers[0] == "httpGet" || handlers[0] == "tcpSocket") && !ports[fmt.Sprint(port)] {
					add("%s: %s probes port %v, which the container does not declare", where, probe, port)
				}
				if handlers[0] == "exec" && len(listOf(dig(p, "exec", "command"))) == 0 {
					add("%s: %s exec has no command", where, probe)
				}
			}
		}
		for _, ef := range listOf(dig(c, "envFrom")) {
			if n := strOf(dig(ef, "configMapRef", "name")); n != "" {
				exists("ConfigMap", n, "envFrom")
			}
			if n := strOf(dig(ef, "secretRef", "name")); n != "" {
				exists("Secret", n, "envFrom")
			}
		}
		var names []string
		values := containerEnv(c, byKind)
		idFromPod, idLiteral := false, false
		for _, e := range listOf(dig(c, "env")) {
			n := strOf(dig(e, "name"))
			names = append(names, n)
			if n == "LEDGER_INSTANCE_ID" {
				idFromPod = strOf(dig(e, "valueFrom", "fieldRef", "fieldPath")) == "metadata.name"
				idLiteral = dig(e, "value") != nil
			}
			if n := strOf(dig(e, "valueFrom", "configMapKeyRef", "name")); n != "" {
				exists("ConfigMap", n, "env "+strOf(dig(e, "name")))
			}
			if n := strOf(dig(e, "valueFrom", "secretKeyRef", "name")); n != "" {
				exists("Secret", n, "env "+strOf(dig(e, "name")))
				// A key the template lacks: the pod does not start. (An
				// optional one, a SASL password, may be absent.)
				key := strOf(dig(e, "valueFrom", "secretKeyRef", "key"))
				optional := dig(e, "valueFrom", "secretKeyRef", "optional") == true
				if sec, ok := byKind["Secret"][n]; ok && !optional && dig(sec.doc, "stringData", key) == nil && dig(sec.doc, "data", key) == nil {
					add("%s: env %s reads key %q of Secret %q, which it lacks", where, strOf(dig(e, "name")), key, n)
				}
			}
		}
		if init || !strings.HasPrefix(strOf(dig(c, "image")), ledgerImage) {
			probs = append(probs, checkEnv(where, names, nil, fs)...)
			return
		}
		args := strList(dig(c, "args"))
		if len(args) == 0 {
			args = strList(dig(c, "command"))
		}
		path := commandPath(args)
		if len(path) == 0 {
			add("%s: runs the ledger image without a command (a role)", where)
			return
		}
		probs = append(probs, checkEnv(where, names, path, fs)...)
		readOnly := map[string]bool{}
		for _, m := range listOf(dig(c, "volumeMounts")) {
			if dig(m, "readOnly") == true {
				readOnly[strOf(dig(m, "mountPath"))] = true
			}
		}
		probs = append(probs, checkPolicies(where, path, values, readOnly, false, fs)...)
		// The roles that hold a Kafka transactional id need an instance id
		// that is unique per pod: the pod's name, or a literal when there
		// is only one pod.
		switch strings.Join(path, " ") {
		case "intake", "executor", "reconciler", "approvals serve":
			switch {
			case idFromPod:
			case idLiteral && replicas == 1:
			case idLiteral:
				add("%s: a literal LEDGER_INSTANCE_ID shared by %d replicas: they would fence each other", where, replicas)
			default:
				add("%s: no LEDGER_INSTANCE_ID (want the pod name, from the downward API)", where)
			}
		}
	}
	for _, c := range containers {
		check(c, false)
	}
	for _, c := range listOf(pod["initContainers"]) {
		check(c, true)
	}
	return probs
}

// containerEnv is the environment a container sees with literal values:
// its envFrom ConfigMaps' data, then its env (which wins).
func containerEnv(c any, byKind map[string]map[string]kubeDoc) map[string]string {
	values := map[string]string{}
	for _, ef := range listOf(dig(c, "envFrom")) {
		for k, v := range mapOf(dig(byKind["ConfigMap"][strOf(dig(ef, "configMapRef", "name"))].doc, "data")) {
			values[k] = fmt.Sprint(v)
		}
	}
	for _, e := range listOf(dig(c, "env")) {
		if v, ok := dig(e, "value").(string); ok {
			values[strOf(dig(e, "name"))] = v
		}
	}
	return values
}

// validateKustomization checks that the kustomization lists every
// manifest file of its directory and nothing else.
func validateKustomization(doc map[string]any, files []string) []string {
	var probs []string
	if strOf(doc["kind"]) != "Kustomization" {
		probs = append(probs, fmt.Sprintf("kustomization.yaml: kind %q, want Kustomization", strOf(doc["kind"])))
	}
	have := map[string]bool{}
	for _, f := range files {
		have[f] = true
	}
	listed := map[string]bool{}
	for _, r := range strList(doc["resources"]) {
		if listed[r] {
			probs = append(probs, fmt.Sprintf("kustomization.yaml: %s listed twice", r))
		}
		listed[r] = true
		if !have[r] {
			probs = append(probs, fmt.Sprintf("kustomization.yaml: lists %s, which does not exist", r))
		}
	}
	for _, f := range files {
		if !listed[f] {
			probs = append(probs, fmt.Sprintf("kustomization.yaml: does not list %s", f))
		}
	}
	return probs
}
