package deploytest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

// realFlags reads the flags of the ledger binary TestMain builds; set once
// before the tests run and only read after.
var realFlags *helpFlags

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	dir, err := os.MkdirTemp("", "deploytest")
	if err != nil {
		fmt.Fprintln(os.Stderr, "deploytest:", err)
		return 1
	}
	defer os.RemoveAll(dir)
	bin := filepath.Join(dir, "ledger")
	gobin := filepath.Join(runtime.GOROOT(), "bin", "go")
	if _, err := os.Stat(gobin); err != nil {
		gobin = "go"
	}
	// Built, not imported: the test knows the flags only as an operator
	// does, from --help.
	build := exec.Command(gobin, "build", "-o", bin, "./cmd/ledger")
	build.Dir = filepath.Join("..", "..")
	if out, err := build.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "deploytest: go build ./cmd/ledger: %v\n%s", err, out)
		return 1
	}
	realFlags = newHelpFlags(bin)
	return m.Run()
}

// TestDeployFiles validates the real files under deploy/compose and
// deploy/kubernetes.
func TestDeployFiles(t *testing.T) {
	root := filepath.Join("..")
	var composeFiles, kubeFiles []string
	for _, dir := range []string{"compose", "kubernetes"} {
		err := filepath.WalkDir(filepath.Join(root, dir), func(p string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() {
				return err
			}
			if ext := filepath.Ext(p); ext != ".yml" && ext != ".yaml" {
				return nil
			}
			if dir == "compose" {
				composeFiles = append(composeFiles, p)
			} else {
				kubeFiles = append(kubeFiles, p)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if len(composeFiles) == 0 || len(kubeFiles) == 0 {
		t.Fatalf("found compose files %v and kubernetes files %v; want both", composeFiles, kubeFiles)
	}

	for _, f := range composeFiles {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		docs, err := parseDocs(data)
		if err != nil {
			t.Errorf("%s: %v", f, err)
			continue
		}
		if len(docs) != 1 {
			t.Errorf("%s: %d documents, want one Compose document", f, len(docs))
			continue
		}
		for _, p := range validateCompose(docs[0], realFlags) {
			t.Errorf("%s: %s", f, p)
		}
		checkComposeIntent(t, f, docs[0])
	}

	var docs []kubeDoc
	kustomizations := map[string]map[string]any{}
	dirFiles := map[string][]string{}
	for _, f := range kubeFiles {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		parsed, err := parseDocs(data)
		if err != nil {
			t.Errorf("%s: %v", f, err)
			continue
		}
		dir, base := filepath.Split(f)
		if base == "kustomization.yaml" || base == "kustomization.yml" {
			if len(parsed) != 1 {
				t.Errorf("%s: %d documents, want 1", f, len(parsed))
				continue
			}
			kustomizations[dir] = parsed[0]
			continue
		}
		dirFiles[dir] = append(dirFiles[dir], base)
		if len(parsed) == 0 {
			t.Errorf("%s: no documents", f)
		}
		for _, d := range parsed {
			docs = append(docs, kubeDoc{file: f, doc: d})
		}
	}
	for _, p := range validateKube(docs, realFlags) {
		t.Error(p)
	}
	for dir, files := range dirFiles {
		k, ok := kustomizations[dir]
		if !ok {
			t.Errorf("%s: no kustomization.yaml", dir)
			continue
		}
		for _, p := range validateKustomization(k, files) {
			t.Errorf("%s%s", dir, p)
		}
	}
	checkKubeIntent(t, docs)
}

// checkComposeIntent checks what the brief of the Compose file promises:
// three brokers replicating 3 with min ISR 2 (the transaction log too),
// three executors.
func checkComposeIntent(t *testing.T, file string, doc map[string]any) {
	t.Helper()
	services := mapOf(doc["services"])
	brokers, executors := 0, 0
	for _, name := range sortedKeys(services) {
		svc := mapOf(services[name])
		if strings.HasPrefix(strOf(svc["image"]), "apache/kafka") && svc["restart"] != "no" {
			brokers++
			got := composeEnv(svc["environment"])
			want := map[string]string{
				"KAFKA_DEFAULT_REPLICATION_FACTOR":               "3",
				"KAFKA_MIN_INSYNC_REPLICAS":                      "2",
				"KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "3",
				"KAFKA_TRANSACTION_STATE_LOG_MIN_ISR":            "2",
				"KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR":         "3",
			}
			for k, v := range want {
				if got[k] != v {
					t.Errorf("%s: service %s: %s=%q, want %q", file, name, k, got[k], v)
				}
			}
		}
		if cmp.Equal(commandPath(commandArgs(svc["command"])), []string{"executor"}) {
			executors++
			// A stopping executor's calls still running end and are
			// recorded within some 25 s: Docker's default 10 s would
			// kill it among them.
			if d, err := time.ParseDuration(strOf(svc["stop_grace_period"])); err != nil || d < 30*time.Second {
				t.Errorf("%s: service %s: stop_grace_period %q; want at least 30s", file, name, strOf(svc["stop_grace_period"]))
			}
		}
	}
	if brokers != 3 || executors != 3 {
		t.Errorf("%s: %d Kafka brokers and %d executors, want 3 and 3", file, brokers, executors)
	}
}

// checkKubeIntent checks that each role runs, the executors three times.
func checkKubeIntent(t *testing.T, docs []kubeDoc) {
	t.Helper()
	roles := map[string]int{}
	for _, d := range docs {
		kind := strOf(d.doc["kind"])
		if kind != "Deployment" && kind != "StatefulSet" && kind != "Job" {
			continue
		}
		for _, c := range listOf(dig(d.doc, "spec", "template", "spec", "containers")) {
			path := strings.Join(commandPath(strList(dig(c, "args"))), " ")
			if path == "" {
				continue
			}
			n := 1
			if r, ok := dig(d.doc, "spec", "replicas").(int); ok {
				n = r
			}
			roles[path] += n
		}
	}
	want := map[string]int{
		"intake": 2, "executor": 3, "reconciler": 1, "projector": 1, "api": 2,
		"approvals serve": 1, "topics create": 1, "migrate": 1, "projector migrate": 1,
	}
	if diff := cmp.Diff(want, roles); diff != "" {
		t.Errorf("pods per role (-want +got):\n%s", diff)
	}
}

// TestHelpFlags checks the flag reader against the real binary: a role's
// own flag, an inherited one, and an unknown command.
func TestHelpFlags(t *testing.T) {
	fs, err := realFlags.Flags([]string{"executor"})
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"instance-id", "crdb-dsn", "kafka-brokers", "jwks-addr"} {
		if !fs[f] {
			t.Errorf("executor --help: no --%s among %v", f, sortedKeys(fs))
		}
	}
	if fs["clickhouse-dsn"] {
		t.Error("executor --help lists --clickhouse-dsn: the reader mixes commands")
	}
	if _, err := realFlags.Flags([]string{"topics", "nonesuch"}); err == nil {
		t.Error("ledger topics nonesuch: no error, want one (an unknown command)")
	}
	all, err := realFlags.All()
	if err != nil {
		t.Fatal(err)
	}
	if !all["clickhouse-dsn"] || !all["crdb-dsn"] || all["nonesuch"] {
		t.Errorf("union of the roles' flags: %v", sortedKeys(all))
	}
}

// fakeFlags is a fixed flag source for the table tests.
type fakeFlags map[string][]string

func (f fakeFlags) Flags(path []string) (map[string]bool, error) {
	names, ok := f[strings.Join(path, " ")]
	if !ok {
		return nil, fmt.Errorf("no command %q", strings.Join(path, " "))
	}
	out := map[string]bool{"kafka-brokers": true, "log-level": true}
	for _, root := range []string{"http-tls-cert", "http-tls-key", "http-tls-client-ca", "http-client-cert", "http-client-key", "http-client-ca"} {
		out[root] = true
	}
	for _, n := range names {
		out[n] = true
	}
	return out, nil
}

func (f fakeFlags) All() (map[string]bool, error) {
	all := map[string]bool{}
	for k := range f {
		fs, _ := f.Flags(strings.Fields(k))
		for n := range fs {
			all[n] = true
		}
	}
	return all, nil
}

var testFlags = fakeFlags{
	"executor":   {"instance-id", "crdb-dsn", "jwks-addr", "policy-dir", "policy-versions-dir"},
	"reconciler": {"instance-id", "crdb-dsn", "jwks-addr", "policy-dir", "policy-versions-dir", "http-addr", "credential-jwks-url"},
	"api":        {"http-addr", "operators-url", "approvals-url"},
	"migrate":    {"crdb-dsn"},
}

const validCompose = `name: t
services:
  db:
    image: postgres
    restart: unless-stopped
    healthcheck: {test: ["CMD", "true"]}
  setup:
    image: ghcr.io/toolcall-ledger/ledger:latest
    restart: "no"
    command: ["migrate"]
    environment: {LEDGER_CRDB_DSN: "x"}
    depends_on: {db: {condition: service_healthy}}
  executor-0:
    image: ghcr.io/toolcall-ledger/ledger:latest
    command: ["executor"]
    environment: &xenv {LEDGER_INSTANCE_ID: "executor-0", LEDGER_KAFKA_BROKERS: "k:9092", LEDGER_POLICY_DIR: "/p", LEDGER_POLICY_VERSIONS_DIR: "/v"}
    volumes: ["state:/var/lib/ledger", "./p:/p:ro", "./v:/v:ro"]
    depends_on: {setup: {condition: service_completed_successfully}}
    healthcheck: {test: ["CMD", "true"]}
  executor-1:
    image: ghcr.io/toolcall-ledger/ledger:latest
    command: ["executor"]
    environment:
      <<: *xenv
      LEDGER_INSTANCE_ID: "executor-1"
    volumes: [{type: bind, source: ./p, target: /p, read_only: true}, "./v:/v:ro"]
    healthcheck: {test: ["CMD", "true"]}
volumes:
  state:
`

// TestComposeChecksFail feeds the Compose validator one broken file per
// check, each the valid file with one change.
func TestComposeChecksFail(t *testing.T) {
	docs, err := parseDocs([]byte(validCompose))
	if err != nil {
		t.Fatal(err)
	}
	if probs := validateCompose(docs[0], testFlags); len(probs) != 0 {
		t.Fatalf("the valid file: %v", probs)
	}
	for _, tc := range []struct {
		name, old, new, want string
	}{
		{"unknown top-level key", "name: t", "nmae: t", `unknown top-level key "nmae"`},
		{"no services", "services:", "servces:", "no services"},
		{"neither image nor build", "    image: postgres\n", "", "service db: neither image nor build"},
		{"depends_on a missing service", "depends_on: {db:", "depends_on: {dbx:", `depends_on "dbx", which is not a service`},
		{"unknown depends_on condition", "condition: service_healthy", "condition: service_up", `unknown condition "service_up"`},
		{"healthy target without healthcheck", "    healthcheck: {test: [\"CMD\", \"true\"]}\n  setup:", "  setup:", `waits for "db" to be healthy, but it has no healthcheck`},
		{"long-running without healthcheck", "    healthcheck: {test: [\"CMD\", \"true\"]}\nvolumes:", "volumes:", "service executor-1: long-running service without a healthcheck"},
		{"LEDGER_ variable of no flag", "LEDGER_KAFKA_BROKERS", "LEDGER_KAFKA_BROKER", "LEDGER_KAFKA_BROKER names no flag of ledger executor (no --kafka-broker)"},
		{"LEDGER_ variable of another command", `{LEDGER_CRDB_DSN: "x"}`, `{LEDGER_CRDB_DSN: "x", LEDGER_INSTANCE_ID: "m"}`, "LEDGER_INSTANCE_ID names no flag of ledger migrate"},
		{"ledger image without a command", "    command: [\"migrate\"]\n", "", "service setup: runs the ledger image without a command"},
		{"unknown ledger command", `command: ["migrate"]`, `command: ["migrat"]`, `no command "migrat"`},
		{"shared instance id", `LEDGER_INSTANCE_ID: "executor-1"`, `LEDGER_INSTANCE_ID: "executor-0"`, "would fence each other's transactions"},
		{"undeclared named volume", "volumes:\n  state:\n", "", `named volume "state" is not declared`},
		{"decides without policy versions", `, LEDGER_POLICY_VERSIONS_DIR: "/v"}`, "}", "ledger executor decides calls but sets no LEDGER_POLICY_VERSIONS_DIR"},
		{"policy versions not mounted", `"./v:/v:ro"]`, `"./v:/w:ro"]`, `LEDGER_POLICY_VERSIONS_DIR "/v" is not a read-only mount`},
		{"decides with the demo policies", `LEDGER_POLICY_DIR: "/p", `, "", "sets no LEDGER_POLICY_DIR"},
		{"policies mounted writable", `target: /p, read_only: true}`, `target: /p}`, `service executor-1: LEDGER_POLICY_DIR "/p" is not a read-only mount`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			probs := composeProblems(t, mutate(t, validCompose, tc.old, tc.new))
			if !anyContains(probs, tc.want) {
				t.Errorf("problems %q; want one containing %q", probs, tc.want)
			}
		})
	}
}

func composeProblems(t *testing.T, src string) []string {
	t.Helper()
	docs, err := parseDocs([]byte(src))
	if err != nil {
		t.Fatalf("parse: %v", err)
	}
	return validateCompose(docs[0], testFlags)
}

// TestParseDocsFails checks that broken YAML is an error, in any document
// of a multi-document file.
func TestParseDocsFails(t *testing.T) {
	for _, tc := range []struct{ name, src, want string }{
		{"unclosed flow sequence", "services: [\n", "document 1"},
		{"bad indentation in the second document", "a: 1\n---\nb:\n  c: 1\n d: 2\n", "document 2"},
		{"duplicate key", "a: 1\na: 2\n", "already defined"},
		{"not a mapping", "- a\n- b\n", "not a mapping"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := parseDocs([]byte(tc.src))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("parseDocs: %v; want an error containing %q", err, tc.want)
			}
		})
	}
	docs, err := parseDocs([]byte("a: 1\n---\n---\nb: 2\n"))
	if err != nil || len(docs) != 2 {
		t.Errorf("two documents and an empty one: %d documents, %v", len(docs), err)
	}
}

const validKube = `apiVersion: v1
kind: Namespace
metadata: {name: ns}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: cfg, namespace: ns}
data: {LEDGER_KAFKA_BROKERS: "k:9092", LEDGER_POLICY_DIR: "/p"}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: policies, namespace: ns}
data: {a.cedar: "permit (principal, action, resource);"}
---
apiVersion: v1
kind: Secret
metadata: {name: sec, namespace: ns}
stringData: {LEDGER_CRDB_DSN: "x"}
---
apiVersion: v1
kind: Service
metadata: {name: executor, namespace: ns}
spec:
  clusterIP: None
  selector: {app: executor}
  ports: [{name: jwks, port: 8443, targetPort: jwks}]
---
apiVersion: apps/v1
kind: StatefulSet
metadata: {name: executor, namespace: ns}
spec:
  serviceName: executor
  replicas: 3
  selector: {matchLabels: {app: executor}}
  template:
    metadata: {labels: {app: executor}}
    spec:
      securityContext: {runAsNonRoot: true}
      volumes:
        - {name: policies, configMap: {name: policies}}
        - {name: tls, secret: {secretName: executor-tls, defaultMode: 0440}}
      containers:
        - name: executor
          image: ghcr.io/toolcall-ledger/ledger:latest
          args: ["executor"]
          envFrom:
            - configMapRef: {name: cfg}
            - secretRef: {name: sec}
          env:
            - name: LEDGER_INSTANCE_ID
              valueFrom: {fieldRef: {fieldPath: metadata.name}}
            - {name: LEDGER_POLICY_VERSIONS_DIR, value: "/v"}
            - {name: LEDGER_JWKS_ADDR, value: ":8443"}
            - {name: LEDGER_HTTP_TLS_CERT, value: "/tls/tls.crt"}
            - {name: LEDGER_HTTP_TLS_KEY, value: "/tls/tls.key"}
          volumeMounts:
            - {name: policies, mountPath: /p, readOnly: true}
            - {name: tls, mountPath: /tls, readOnly: true}
          ports: [{name: jwks, containerPort: 8443}]
          readinessProbe: {httpGet: {path: /x, port: jwks, scheme: HTTPS}}
          livenessProbe: {tcpSocket: {port: jwks}}
          startupProbe: {tcpSocket: {port: jwks}}
          resources: {requests: {cpu: 1, memory: 1Mi}, limits: {cpu: 1, memory: 1Mi}}
          securityContext: {readOnlyRootFilesystem: true, allowPrivilegeEscalation: false}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata: {name: executor, namespace: ns}
spec:
  minAvailable: 2
  selector: {matchLabels: {app: executor}}
---
apiVersion: batch/v1
kind: Job
metadata: {name: migrate, namespace: ns}
spec:
  template:
    spec:
      restartPolicy: OnFailure
      securityContext: {runAsNonRoot: true}
      containers:
        - name: migrate
          image: ghcr.io/toolcall-ledger/ledger:latest
          args: ["migrate"]
          envFrom: [{secretRef: {name: sec}}]
          resources: {requests: {cpu: 100m, memory: 1Mi}, limits: {cpu: 1, memory: 1Mi}}
          securityContext: {readOnlyRootFilesystem: true, allowPrivilegeEscalation: false}
---
apiVersion: v1
kind: Service
metadata: {name: reconciler, namespace: ns}
spec:
  selector: {app: reconciler}
  ports: [{name: http, port: 8091, targetPort: http}]
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: reconciler, namespace: ns}
spec:
  replicas: 1
  selector: {matchLabels: {app: reconciler}}
  template:
    metadata: {labels: {app: reconciler}}
    spec:
      securityContext: {runAsNonRoot: true}
      volumes:
        - {name: policies, configMap: {name: policies}}
        - {name: tls, secret: {secretName: reconciler-tls}}
      containers:
        - name: reconciler
          image: ghcr.io/toolcall-ledger/ledger:latest
          args: ["reconciler"]
          envFrom: [{configMapRef: {name: cfg}}]
          env:
            - {name: LEDGER_INSTANCE_ID, value: "reconciler-0"}
            - {name: LEDGER_POLICY_VERSIONS_DIR, value: "/v"}
            - {name: LEDGER_HTTP_ADDR, value: ":8091"}
            - {name: LEDGER_HTTP_TLS_CERT, value: "/etc/tls/tls.crt"}
            - {name: LEDGER_HTTP_TLS_KEY, value: "/etc/tls/tls.key"}
            - {name: LEDGER_HTTP_CLIENT_CA, value: "/etc/tls/ca.crt"}
            - {name: LEDGER_CREDENTIAL_JWKS_URL, value: "https://executor-0.executor.ns.svc:8443/.well-known/jwks.json,https://executor-1.executor.ns.svc.cluster.local:8443/.well-known/jwks.json,https://executor-2.executor.ns.svc:8443/.well-known/jwks.json"}
          volumeMounts:
            - {name: policies, mountPath: /p, readOnly: true}
            - {name: tls, mountPath: /etc/tls, readOnly: true}
          ports: [{name: http, containerPort: 8091}]
          readinessProbe: {httpGet: {path: /readyz, port: http, scheme: HTTPS}}
          livenessProbe: {tcpSocket: {port: http}}
          startupProbe: {tcpSocket: {port: http}}
          resources: {requests: {cpu: 1, memory: 1Mi}, limits: {cpu: 1, memory: 1Mi}}
          securityContext: {readOnlyRootFilesystem: true, allowPrivilegeEscalation: false}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: api, namespace: ns}
spec:
  replicas: 2
  selector: {matchLabels: {app: api}}
  template:
    metadata: {labels: {app: api}}
    spec:
      securityContext: {runAsNonRoot: true}
      volumes:
        - {name: ca, secret: {secretName: reconciler-tls, items: [{key: ca.crt, path: ca.crt}]}}
      containers:
        - name: api
          image: ghcr.io/toolcall-ledger/ledger:latest
          args: ["api"]
          env:
            - {name: LEDGER_HTTP_ADDR, value: ":8080"}
            - {name: LEDGER_OPERATORS_URL, value: "https://reconciler.ns.svc:8091"}
            - {name: LEDGER_HTTP_CLIENT_CA, value: "/ca/ca.crt"}
          volumeMounts: [{name: ca, mountPath: /ca, readOnly: true}]
          ports: [{name: http, containerPort: 8080}]
          readinessProbe: {httpGet: {path: /healthz, port: http}}
          livenessProbe: {tcpSocket: {port: http}}
          startupProbe: {tcpSocket: {port: http}}
          resources: {requests: {cpu: 1, memory: 1Mi}, limits: {cpu: 1, memory: 1Mi}}
          securityContext: {readOnlyRootFilesystem: true, allowPrivilegeEscalation: false}
---
apiVersion: cert-manager.io/v1
kind: Issuer
metadata: {name: self, namespace: ns}
spec: {selfSigned: {}}
---
apiVersion: cert-manager.io/v1
kind: Certificate
metadata: {name: ca, namespace: ns}
spec: {isCA: true, commonName: ca, secretName: ca, issuerRef: {name: self}}
---
apiVersion: cert-manager.io/v1
kind: Issuer
metadata: {name: ca, namespace: ns}
spec: {ca: {secretName: ca}}
---
apiVersion: cert-manager.io/v1
kind: Certificate
metadata: {name: executor-tls, namespace: ns}
spec:
  secretName: executor-tls
  dnsNames: ["*.executor.ns.svc", "*.executor.ns.svc.cluster.local"]
  issuerRef: {name: ca, kind: Issuer}
---
apiVersion: cert-manager.io/v1
kind: Certificate
metadata: {name: reconciler-tls, namespace: ns}
spec:
  secretName: reconciler-tls
  dnsNames: [reconciler.ns.svc]
  issuerRef: {name: ca}
`

// TestKubeChecksFail feeds the Kubernetes validator one broken set per
// check, each the valid set with one change.
func TestKubeChecksFail(t *testing.T) {
	if probs := kubeProblems(t, validKube); len(probs) != 0 {
		t.Fatalf("the valid set: %v", probs)
	}
	for _, tc := range []struct {
		name, old, new, want string
	}{
		{"no kind", "kind: Namespace", "knd: Namespace", "apiVersion, kind and metadata.name are all required"},
		{"no metadata.name", "metadata: {name: cfg, namespace: ns}", "metadata: {namespace: ns}", "apiVersion, kind and metadata.name are all required"},
		{"unknown kind", "kind: PodDisruptionBudget", "kind: PodDisruptionBudgt", `unknown kind "PodDisruptionBudgt"`},
		{"wrong apiVersion", "apiVersion: policy/v1", "apiVersion: policy/v1beta1", `apiVersion "policy/v1beta1", want "policy/v1"`},
		{"namespace not in the set", "{name: cfg, namespace: ns}", "{name: cfg, namespace: other}", `namespace "other" is not in the set`},
		{"selector does not match template", "  selector: {matchLabels: {app: executor}}\n  template:", "  selector: {matchLabels: {app: executr}}\n  template:", "does not match the template's labels"},
		{"serviceName not a Service", "serviceName: executor", "serviceName: exec", `serviceName "exec" is not a Service`},
		{"no readiness probe", "          readinessProbe: {httpGet: {path: /x, port: jwks, scheme: HTTPS}}\n", "", "readinessProbe needs exactly one handler"},
		{"no liveness probe", "          livenessProbe: {tcpSocket: {port: jwks}}\n", "", "livenessProbe needs exactly one handler"},
		{"no startup probe", "          startupProbe: {tcpSocket: {port: jwks}}\n", "", "startupProbe needs exactly one handler"},
		{"probe on an undeclared port", "livenessProbe: {tcpSocket: {port: jwks}}", "livenessProbe: {tcpSocket: {port: http}}", "probes port http, which the container does not declare"},
		{"no memory limit", "limits: {cpu: 1, memory: 1Mi}", "limits: {cpu: 1}", "no resources.limits.memory"},
		{"job without resources", "resources: {requests: {cpu: 100m, memory: 1Mi}, limits: {cpu: 1, memory: 1Mi}}", "resources: {}", "Job/migrate container migrate: no resources.requests.cpu"},
		{"writable root fs", "{readOnlyRootFilesystem: true, allowPrivilegeEscalation: false}", "{readOnlyRootFilesystem: false, allowPrivilegeEscalation: false}", "readOnlyRootFilesystem is not true"},
		{"privilege escalation", "{readOnlyRootFilesystem: true, allowPrivilegeEscalation: false}", "{readOnlyRootFilesystem: true}", "allowPrivilegeEscalation is not false"},
		{"root allowed", "securityContext: {runAsNonRoot: true}", "securityContext: {}", "runAsNonRoot is not true"},
		{"fsGroup chmodding every mount", "securityContext: {runAsNonRoot: true}", "securityContext: {runAsNonRoot: true, fsGroup: 1}", "sets fsGroup without fsGroupChangePolicy: OnRootMismatch"},
		{"PDB selects nothing", "  minAvailable: 2\n  selector: {matchLabels: {app: executor}}", "  minAvailable: 2\n  selector: {matchLabels: {app: nothing}}", "PodDisruptionBudget/executor: selector map[app:nothing] matches no Deployment or StatefulSet"},
		{"Service selects nothing", "  selector: {app: executor}", "  selector: {app: nothing}", "Service/executor: selector map[app:nothing] matches no"},
		{"envFrom ConfigMap missing", "configMapRef: {name: cfg}", "configMapRef: {name: cfg2}", `envFrom refers to ConfigMap "cfg2", which is not in the set`},
		{"envFrom Secret missing", "envFrom: [{secretRef: {name: sec}}]", "envFrom: [{secretRef: {name: sec2}}]", `envFrom refers to Secret "sec2", which is not in the set`},
		{"ConfigMap key of no flag", "LEDGER_KAFKA_BROKERS", "LEDGER_KAFKA_BROKERZ", "LEDGER_KAFKA_BROKERZ names no flag of any ledger role"},
		{"container env of no flag", "- name: LEDGER_INSTANCE_ID", "- name: LEDGER_INSTANCE", "LEDGER_INSTANCE names no flag of ledger executor"},
		{"no instance id", "- name: LEDGER_INSTANCE_ID", "- name: LEDGER_CRDB_DSN", "no LEDGER_INSTANCE_ID"},
		{"instance id shared by replicas", "valueFrom: {fieldRef: {fieldPath: metadata.name}}", `value: "executor-0"`, "a literal LEDGER_INSTANCE_ID shared by 3 replicas"},
		{"unknown ledger command", `args: ["migrate"]`, `args: ["migrat"]`, `no command "migrat"`},
		{"decides without policy versions", `            - {name: LEDGER_POLICY_VERSIONS_DIR, value: "/v"}
`, "", "ledger executor decides calls but sets no LEDGER_POLICY_VERSIONS_DIR"},
		{"decides with the demo policies", `, LEDGER_POLICY_DIR: "/p"}`, "}", "ledger executor decides calls but sets no LEDGER_POLICY_DIR"},
		{"policies mounted writable", "mountPath: /p, readOnly: true", "mountPath: /p", `LEDGER_POLICY_DIR "/p" is not a read-only mount`},
		{"volume ConfigMap missing", "configMap: {name: policies}", "configMap: {name: policiez}", `volume refers to ConfigMap "policiez", which is not in the set`},
		{"volume Secret of no Certificate", "secretName: executor-tls, defaultMode", "secretName: executor-tlz, defaultMode", `volume refers to Secret "executor-tlz", which is not in the set`},
		{"Certificate of no Issuer", "issuerRef: {name: ca}", "issuerRef: {name: cx}", `Certificate/reconciler-tls: issuerRef names Issuer "cx", which is not in the set`},
		{"Issuer's CA not in the set", "spec: {ca: {secretName: ca}}", "spec: {ca: {secretName: cb}}", `Issuer/ca: spec.ca.secretName "cb" is not a Secret in the set`},
		{"Certificate without names", "  dnsNames: [reconciler.ns.svc]\n", "", "Certificate/reconciler-tls: no spec.dnsNames"},
		{"keys served over plain HTTP", `            - {name: LEDGER_HTTP_TLS_CERT, value: "/tls/tls.crt"}
            - {name: LEDGER_HTTP_TLS_KEY, value: "/tls/tls.key"}
`, "", "StatefulSet/executor container executor: serves its credential keys (LEDGER_JWKS_ADDR :8443) over plain HTTP"},
		{"certificate without its key", `            - {name: LEDGER_HTTP_TLS_KEY, value: "/tls/tls.key"}
`, "", "LEDGER_HTTP_TLS_CERT and LEDGER_HTTP_TLS_KEY go together"},
		{"certificate on no mount", `value: "/tls/tls.crt"`, `value: "/tlz/tls.crt"`, `LEDGER_HTTP_TLS_CERT "/tlz/tls.crt" is on no volume mount`},
		{"certificate on a subPath mount", "{name: tls, mountPath: /tls, readOnly: true}", "{name: tls, mountPath: /tls/tls.crt, subPath: tls.crt, readOnly: true}", `LEDGER_HTTP_TLS_CERT "/tls/tls.crt" is on a subPath mount`},
		{"CA file not projected", "items: [{key: ca.crt, path: ca.crt}]", "items: [{key: ca.crt, path: ca.pem}]", `LEDGER_HTTP_CLIENT_CA "/ca/ca.crt": the mount of Secret "reconciler-tls" does not project it`},
		{"CA file not the CA", `value: "/etc/tls/ca.crt"`, `value: "/etc/tls/tls.crt"`, `LEDGER_HTTP_CLIENT_CA "/etc/tls/tls.crt" is tls.crt of test.yaml: Certificate/reconciler-tls's Secret, want ca.crt`},
		{"TLS role probed over HTTP", "port: jwks, scheme: HTTPS}", "port: jwks}", "StatefulSet/executor container executor: readinessProbe asks plain HTTP of a role that serves HTTPS"},
		{"plain role probed over HTTPS", "{path: /healthz, port: http}", "{path: /healthz, port: http, scheme: HTTPS}", "Deployment/api container api: readinessProbe asks HTTPS of a role that serves plain HTTP"},
		{"mutual TLS role probed", `            - {name: LEDGER_HTTP_TLS_KEY, value: "/tls/tls.key"}
`, `            - {name: LEDGER_HTTP_TLS_KEY, value: "/tls/tls.key"}
            - {name: LEDGER_HTTP_TLS_CLIENT_CA, value: "/tls/ca.crt"}
`, "readinessProbe is an httpGet probe of servers that require client certificates"},
		{"http URL to a TLS role", `"https://reconciler.ns.svc:8091"`, `"http://reconciler.ns.svc:8091"`, `Deployment/api container api: LEDGER_OPERATORS_URL "http://reconciler.ns.svc:8091" is http, but test.yaml: Deployment/reconciler container reconciler serves HTTPS`},
		{"https URL to a plain role", `            - {name: LEDGER_HTTP_TLS_CERT, value: "/etc/tls/tls.crt"}
            - {name: LEDGER_HTTP_TLS_KEY, value: "/etc/tls/tls.key"}
`, "", `LEDGER_OPERATORS_URL "https://reconciler.ns.svc:8091" is https, but test.yaml: Deployment/reconciler container reconciler serves plain HTTP`},
		{"https URL without a CA", `            - {name: LEDGER_HTTP_CLIENT_CA, value: "/ca/ca.crt"}
`, "", `LEDGER_OPERATORS_URL "https://reconciler.ns.svc:8091" is https, but the role sets no LEDGER_HTTP_CLIENT_CA`},
		{"host the certificate does not name", `"https://reconciler.ns.svc:8091"`, `"https://reconciler:8091"`, "host reconciler is none of the names of test.yaml: Certificate/reconciler-tls"},
		{"URL of no Service", `"https://reconciler.ns.svc:8091"`, `"https://reconcilr.ns.svc:8091"`, `names Service ns/reconcilr, which is not in the set`},
		{"URL of no Service port", `"https://reconciler.ns.svc:8091"`, `"https://reconciler.ns.svc:8092"`, "port 8092 is not a port of test.yaml: Service/reconciler"},
		{"CA of another issuer", "issuerRef: {name: ca, kind: Issuer}", "issuerRef: {name: self, kind: Issuer}", "LEDGER_HTTP_CLIENT_CA is the CA of test.yaml: Certificate/reconciler-tls, but test.yaml: StatefulSet/executor container executor's certificate test.yaml: Certificate/executor-tls is issued by Issuer/self"},
		{"verifier of no keys", `            - {name: LEDGER_CREDENTIAL_JWKS_URL, value:`, `            - {name: LEDGER_CREDENTIALS_JWKS_URL, value:`, "ledger reconciler verifies credentials but sets no LEDGER_CREDENTIAL_JWKS_URL"},
		{"verifier missing a pod's keys", ",https://executor-2.executor.ns.svc:8443/.well-known/jwks.json", "", "LEDGER_CREDENTIAL_JWKS_URL lists no keys of pod executor-2 (https://executor-2.executor.ns.svc:8443/.well-known/jwks.json)"},
		{"keys of a pod of no StatefulSet", "https://executor-2.executor.ns.svc:8443", "https://executor-2.reconciler.ns.svc:8443", "names pod executor-2, but no StatefulSet of the set is governed by test.yaml: Service/reconciler"},
		{"keys at a port the pod does not serve", "executor-0.executor.ns.svc:8443", "executor-0.executor.ns.svc:8444", `port 8444 is not a port of test.yaml: StatefulSet/executor container executor`},
		{"keys at another path", "executor-0.executor.ns.svc:8443/.well-known/jwks.json", "executor-0.executor.ns.svc:8443/jwks.json", `path "/jwks.json", want /.well-known/jwks.json`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			probs := kubeProblems(t, mutate(t, validKube, tc.old, tc.new))
			if !anyContains(probs, tc.want) {
				t.Errorf("problems %q; want one containing %q", probs, tc.want)
			}
		})
	}
}

func kubeProblems(t *testing.T, src string) []string {
	t.Helper()
	parsed, err := parseDocs([]byte(src))
	if err != nil {
		t.Fatalf("parse: %v", err)
	}
	var docs []kubeDoc
	for _, d := range parsed {
		docs = append(docs, kubeDoc{file: "test.yaml", doc: d})
	}
	return validateKube(docs, testFlags)
}

// TestKustomizationChecksFail checks that the kustomization must list
// exactly the manifest files.
func TestKustomizationChecksFail(t *testing.T) {
	files := []string{"a.yaml", "b.yaml"}
	for _, tc := range []struct {
		name, src string
		want      []string
	}{
		{"exact", "kind: Kustomization\nresources: [a.yaml, b.yaml]\n", nil},
		{"missing file", "kind: Kustomization\nresources: [a.yaml]\n", []string{"kustomization.yaml: does not list b.yaml"}},
		{"file that does not exist", "kind: Kustomization\nresources: [a.yaml, b.yaml, c.yaml]\n", []string{"kustomization.yaml: lists c.yaml, which does not exist"}},
		{"listed twice", "kind: Kustomization\nresources: [a.yaml, b.yaml, a.yaml]\n", []string{"kustomization.yaml: a.yaml listed twice"}},
		{"wrong kind", "kind: Kustomisation\nresources: [a.yaml, b.yaml]\n", []string{`kustomization.yaml: kind "Kustomisation", want Kustomization`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			docs, err := parseDocs([]byte(tc.src))
			if err != nil {
				t.Fatal(err)
			}
			got := validateKustomization(docs[0], files)
			sort.Strings(got)
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("problems (-want +got):\n%s", diff)
			}
		})
	}
}

// TestParseHelp checks the help reader on text shaped like cobra's,
// including a help printed for another command than the one asked for.
func TestParseHelp(t *testing.T) {
	help := `Run an executor

Usage:
  ledger executor [flags]

Flags:
      --crdb-dsn string   DSN
  -h, --help              help for executor
      --clickhouse-dsn ` + "ledger dev" + `    DSN, with a backquoted word

Global Flags:
      --kafka-brokers strings   brokers
`
	got, err := parseHelp([]string{"executor"}, help)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]bool{"crdb-dsn": true, "help": true, "clickhouse-dsn": true, "kafka-brokers": true}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("flags (-want +got):\n%s", diff)
	}
	if _, err := parseHelp([]string{"executr"}, help); err == nil {
		t.Error("help of executor read as executr's: no error")
	}
}

// mutate replaces the first old in src by new, failing if old is absent
// (a table entry that changes nothing would pass for the wrong reason).
func mutate(t *testing.T, src, old, new string) string {
	t.Helper()
	if !strings.Contains(src, old) {
		t.Fatalf("%q is not in the valid document", old)
	}
	return strings.Replace(src, old, new, 1)
}

func anyContains(probs []string, want string) bool {
	for _, p := range probs {
		if strings.Contains(p, want) {
			return true
		}
	}
	return false
}
