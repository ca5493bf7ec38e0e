package deploytest

import (
	"fmt"
	"net"
	"net/url"
	"path"
	"slices"
	"strings"
)

// --- HTTPS between the roles ------------------------------------------------

// role is a long-running ledger container of a Kubernetes set, with what
// the HTTPS checks read.
type role struct {
	d        kubeDoc // its Deployment or StatefulSet
	pod      map[string]any
	c        any
	where    string
	path     []string
	env      map[string]string
	replicas int
}

// tls reports whether the role's HTTP servers serve HTTPS: --http-tls-*
// are root flags, so all of them do (metrics and probes too).
func (r role) tls() bool { return r.env["LEDGER_HTTP_TLS_CERT"] != "" }

func (r role) namespace() string { return strOf(dig(r.d.doc, "metadata", "namespace")) }

// clientURLVars are the URLs the ledger's own HTTP clients fetch, with the
// CAs of --http-client-ca. The identity provider's LEDGER_JWKS_URL and
// the tools' URLs are fetched otherwise, so they are not here.
var clientURLVars = []string{"LEDGER_CREDENTIAL_JWKS_URL", "LEDGER_OPERATORS_URL", "LEDGER_APPROVALS_URL", "LEDGER_INTROSPECT_URL"}

// tlsFiles are the variables naming the TLS flags' files, each with the
// key of a cert-manager Secret that holds what the flag wants.
var tlsFiles = []struct{ env, key string }{
	{"LEDGER_HTTP_TLS_CERT", "tls.crt"},
	{"LEDGER_HTTP_TLS_KEY", "tls.key"},
	{"LEDGER_HTTP_TLS_CLIENT_CA", "ca.crt"},
	{"LEDGER_HTTP_CLIENT_CERT", "tls.crt"},
	{"LEDGER_HTTP_CLIENT_KEY", "tls.key"},
	{"LEDGER_HTTP_CLIENT_CA", "ca.crt"},
}

// jwksPath is where a credential broker's --jwks-addr serves its keys.
const jwksPath = "/.well-known/jwks.json"

// ledgerRoles lists the ledger containers of the set's Deployments and
// StatefulSets.
func ledgerRoles(byKind map[string]map[string]kubeDoc) []role {
	var roles []role
	for _, kind := range []string{"Deployment", "StatefulSet"} {
		for _, name := range sortedKeys(byKind[kind]) {
			d := byKind[kind][name]
			replicas := 1
			if r, ok := dig(d.doc, "spec", "replicas").(int); ok {
				replicas = r
			}
			pod := mapOf(dig(d.doc, "spec", "template", "spec"))
			for _, c := range listOf(pod["containers"]) {
				if !strings.HasPrefix(strOf(dig(c, "image")), ledgerImage) {
					continue
				}
				args := strList(dig(c, "args"))
				if len(args) == 0 {
					args = strList(dig(c, "command"))
				}
				roles = append(roles, role{
					d: d, pod: pod, c: c, replicas: replicas,
					where: fmt.Sprintf("%s container %s", d.where(), strOf(dig(c, "name"))),
					path:  commandPath(args),
					env:   containerEnv(c, byKind),
				})
			}
		}
	}
	return roles
}

// checkHTTPS checks that the roles' HTTPS fits together: a role that
// serves credential keys serves them over TLS (verifiers refuse http off
// loopback), its probes ask HTTPS, every URL one role gives another's
// server has the scheme that server speaks, a CA to check it with, and a
// host its certificate names, and every credential verifier lists every
// broker's keys. The certificates' files are on Secret mounts that see
// renewals, and cert-manager's objects refer to each other.
func checkHTTPS(byKind map[string]map[string]kubeDoc, fs flagSource) []string {
	var probs []string
	add := func(format string, a ...any) { probs = append(probs, fmt.Sprintf(format, a...)) }
	for _, name := range sortedKeys(byKind["Issuer"]) {
		d := byKind["Issuer"][name]
		if s := strOf(dig(d.doc, "spec", "ca", "secretName")); s != "" {
			if _, ok := byKind["Secret"][s]; !ok {
				add("%s: spec.ca.secretName %q is not a Secret in the set", d.where(), s)
			}
		}
	}
	for _, name := range sortedKeys(byKind["Certificate"]) {
		d := byKind["Certificate"][name]
		kind, issuer := issuerOf(d)
		if kind == "Issuer" {
			if _, ok := byKind["Issuer"][issuer]; !ok {
				add("%s: issuerRef names Issuer %q, which is not in the set", d.where(), issuer)
			}
		}
		if len(listOf(dig(d.doc, "spec", "dnsNames"))) == 0 && dig(d.doc, "spec", "isCA") != true {
			add("%s: no spec.dnsNames", d.where())
		}
	}

	roles := ledgerRoles(byKind)
	for _, r := range roles {
		for _, f := range tlsFiles {
			file := r.env[f.env]
			if file == "" {
				continue
			}
			m, v := r.mountOf(file)
			switch {
			case m == nil:
				add("%s: %s %q is on no volume mount", r.where, f.env, file)
				continue
			case dig(m, "subPath") != nil || dig(m, "subPathExpr") != nil:
				add("%s: %s %q is on a subPath mount, which never sees the Secret change: a renewed certificate would not reach the role", r.where, f.env, file)
			}
			secret, key, projected := secretFile(m, v, file)
			if !projected {
				add("%s: %s %q: the mount of Secret %q does not project it", r.where, f.env, file, secret)
				continue
			}
			if cert := certificateOf(byKind, secret); cert != nil && key != f.key && (f.key != "ca.crt" || dig(cert.doc, "spec", "isCA") != true || key != "tls.crt") {
				add("%s: %s %q is %s of %s's Secret, want %s", r.where, f.env, file, key, cert.where(), f.key)
			}
		}
		if (r.env["LEDGER_HTTP_TLS_CERT"] == "") != (r.env["LEDGER_HTTP_TLS_KEY"] == "") {
			add("%s: LEDGER_HTTP_TLS_CERT and LEDGER_HTTP_TLS_KEY go together", r.where)
		}
		if addr := r.env["LEDGER_JWKS_ADDR"]; addr != "" && !loopback(addr) && !r.tls() {
			add("%s: serves its credential keys (LEDGER_JWKS_ADDR %s) over plain HTTP, which verifiers refuse off loopback: set LEDGER_HTTP_TLS_CERT and LEDGER_HTTP_TLS_KEY", r.where, addr)
		}
		for _, probe := range []string{"readinessProbe", "livenessProbe", "startupProbe"} {
			get := mapOf(dig(r.c, probe, "httpGet"))
			if get == nil {
				continue
			}
			scheme := strings.ToUpper(strOf(get["scheme"]))
			switch {
			case r.tls() && scheme != "HTTPS":
				add("%s: %s asks plain HTTP of a role that serves HTTPS (LEDGER_HTTP_TLS_CERT): set scheme: HTTPS", r.where, probe)
			case !r.tls() && scheme == "HTTPS":
				add("%s: %s asks HTTPS of a role that serves plain HTTP", r.where, probe)
			case r.env["LEDGER_HTTP_TLS_CLIENT_CA"] != "":
				add("%s: %s is an httpGet probe of servers that require client certificates (LEDGER_HTTP_TLS_CLIENT_CA), which the kubelet does not present", r.where, probe)
			}
		}
		for _, v := range clientURLVars {
			for _, raw := range strings.Split(r.env[v], ",") {
				if raw = strings.TrimSpace(raw); raw != "" {
					probs = append(probs, checkClientURL(r, v, raw, roles, byKind)...)
				}
			}
		}
		if flags, err := fs.Flags(r.path); err == nil && flags["credential-jwks-url"] {
			probs = append(probs, checkVerifierKeys(r, roles, byKind)...)
		}
	}
	return probs
}

// checkClientURL checks one URL the ledger's HTTP clients of role r fetch
// (the value of variable v): if its host is a Service of the set, the
// scheme is the one the roles behind it serve, an https URL comes with
// the CA (LEDGER_HTTP_CLIENT_CA) that signed their certificate, and the
// certificate names the host. A host outside the cluster is not checked.
func checkClientURL(r role, v, raw string, roles []role, byKind map[string]map[string]kubeDoc) []string {
	var probs []string
	add := func(format string, a ...any) { probs = append(probs, fmt.Sprintf(format, a...)) }
	u, err := url.Parse(raw)
	if err != nil || u.Host == "" || (u.Scheme != "http" && u.Scheme != "https") {
		return []string{fmt.Sprintf("%s: %s %q is not an http(s) URL", r.where, v, raw)}
	}
	t, ok := resolveHost(u.Hostname(), r.namespace(), byKind)
	if !ok {
		return nil
	}
	if t.svc == nil {
		return []string{fmt.Sprintf("%s: %s %q names Service %s/%s, which is not in the set", r.where, v, raw, t.ns, t.svcName)}
	}
	port := u.Port()
	if port == "" {
		port = map[string]string{"http": "80", "https": "443"}[u.Scheme]
	}
	targets := t.targets(roles)
	hasPort := func(ports any, field string) bool {
		return slices.ContainsFunc(listOf(ports), func(p any) bool { return fmt.Sprint(dig(p, field)) == port })
	}
	switch {
	case t.pod == "" && !hasPort(dig(t.svc.doc, "spec", "ports"), "port"):
		add("%s: %s %q: port %s is not a port of %s", r.where, v, raw, port, t.svc.where())
	case t.pod != "" && len(targets) == 0:
		add("%s: %s %q names pod %s, but no StatefulSet of the set is governed by %s", r.where, v, raw, t.pod, t.svc.where())
	case t.pod != "" && !hasPort(dig(targets[0].c, "ports"), "containerPort"):
		// A pod's own name reaches its container ports, whatever the
		// headless Service lists.
		add("%s: %s %q: port %s is not a port of %s", r.where, v, raw, port, targets[0].where)
	}
	// A pod the StatefulSet no longer runs is not a mistake: a verifier
	// keeps a retired executor's URL until its last credentials expire.
	for _, b := range targets {
		switch {
		case u.Scheme == "http" && b.tls():
			add("%s: %s %q is http, but %s serves HTTPS (LEDGER_HTTP_TLS_CERT)", r.where, v, raw, b.where)
		case u.Scheme == "https" && !b.tls():
			add("%s: %s %q is https, but %s serves plain HTTP (no LEDGER_HTTP_TLS_CERT)", r.where, v, raw, b.where)
		case u.Scheme == "https" && r.env["LEDGER_HTTP_CLIENT_CA"] == "":
			add("%s: %s %q is https, but the role sets no LEDGER_HTTP_CLIENT_CA: the system's roots do not know the CA of %s's certificate", r.where, v, raw, b.where)
		case u.Scheme == "https":
			cert := certificateOf(byKind, b.fileSecret("LEDGER_HTTP_TLS_CERT"))
			if cert == nil {
				continue
			}
			if names := strList(dig(cert.doc, "spec", "dnsNames")); !slices.ContainsFunc(names, func(n string) bool { return dnsNameCovers(n, u.Hostname()) }) {
				add("%s: %s %q: host %s is none of the names of %s (%v), which %s serves", r.where, v, raw, u.Hostname(), cert.where(), names, b.where)
			}
			ca := certificateOf(byKind, r.fileSecret("LEDGER_HTTP_CLIENT_CA"))
			if ca == nil {
				continue
			}
			kind, issuer := issuerOf(*cert)
			if !slices.Contains(trustedIssuers(*ca, byKind), kind+"/"+issuer) {
				add("%s: %s %q: LEDGER_HTTP_CLIENT_CA is the CA of %s, but %s's certificate %s is issued by %s/%s", r.where, v, raw, ca.where(), b.where, cert.where(), kind, issuer)
			}
		}
	}
	return probs
}

// checkVerifierKeys checks that a credential verifier (a role with
// --credential-jwks-url: the reconciler's introspection) lists the keys
// of every other role that serves them: each pod of a StatefulSet by its
// own name under the headless Service (each executor signs with keys of
// its own), a Deployment through a Service selecting it.
func checkVerifierKeys(r role, roles []role, byKind map[string]map[string]kubeDoc) []string {
	list := r.env["LEDGER_CREDENTIAL_JWKS_URL"]
	if list == "" {
		return []string{fmt.Sprintf("%s: ledger %s verifies credentials but sets no LEDGER_CREDENTIAL_JWKS_URL: it knows no executor's keys, and tools cannot check credentials with it", r.where, strings.Join(r.path, " "))}
	}
	var probs []string
	listed := map[string]bool{} // "pod:port", or "Service/name:port"
	for _, raw := range strings.Split(list, ",") {
		u, err := url.Parse(strings.TrimSpace(raw))
		if err != nil {
			continue // checkClientURL says so
		}
		if u.Path != jwksPath {
			probs = append(probs, fmt.Sprintf("%s: LEDGER_CREDENTIAL_JWKS_URL %q: path %q, want %s", r.where, raw, u.Path, jwksPath))
		}
		if t, ok := resolveHost(u.Hostname(), r.namespace(), byKind); ok && t.svc != nil {
			if t.pod != "" {
				listed[t.pod+":"+u.Port()] = true
			} else {
				listed["Service/"+t.svcName+":"+u.Port()] = true
			}
		}
	}
	for _, b := range roles {
		addr := b.env["LEDGER_JWKS_ADDR"]
		if b.d.where() == r.d.where() || addr == "" || loopback(addr) {
			continue // a verifier knows its own keys
		}
		_, port, _ := net.SplitHostPort(addr)
		if strOf(b.d.doc["kind"]) == "StatefulSet" {
			svc := strOf(dig(b.d.doc, "spec", "serviceName"))
			for i := range b.replicas {
				pod := fmt.Sprintf("%s-%d", strOf(dig(b.d.doc, "metadata", "name")), i)
				if !listed[pod+":"+port] {
					probs = append(probs, fmt.Sprintf("%s: LEDGER_CREDENTIAL_JWKS_URL lists no keys of pod %s (https://%s.%s.%s.svc:%s%s): what it signs would not verify", r.where, pod, pod, svc, b.namespace(), port, jwksPath))
				}
			}
			continue
		}
		found := false
		for _, name := range sortedKeys(byKind["Service"]) {
			if sel := mapOf(dig(byKind["Service"][name].doc, "spec", "selector")); len(sel) > 0 && labelsMatch(sel, b.labels()) && listed["Service/"+name+":"+port] {
				found = true
			}
		}
		if !found {
			probs = append(probs, fmt.Sprintf("%s: LEDGER_CREDENTIAL_JWKS_URL lists no keys of %s (LEDGER_JWKS_ADDR %s): what it signs would not verify", r.where, b.where, addr))
		}
	}
	return probs
}

// target is what an in-cluster host names: a Service, and with a
// headless Service's pod form (pod.service.namespace.svc), one pod.
type target struct {
	svcName, ns, pod string
	svc              *kubeDoc // nil: not in the set
}

// targets are the roles behind the target: those the Service selects, or
// with a pod name the StatefulSet the Service governs.
func (t target) targets(roles []role) []role {
	var out []role
	for _, b := range roles {
		if t.pod != "" {
			if strOf(b.d.doc["kind"]) == "StatefulSet" && strOf(dig(b.d.doc, "spec", "serviceName")) == t.svcName && strings.HasPrefix(t.pod, strOf(dig(b.d.doc, "metadata", "name"))+"-") {
				out = append(out, b)
			}
			continue
		}
		if sel := mapOf(dig(t.svc.doc, "spec", "selector")); len(sel) > 0 && labelsMatch(sel, b.labels()) {
			out = append(out, b)
		}
	}
	return out
}

// resolveHost reads host as the cluster's DNS would: service,
// service.namespace, service.namespace.svc, pod.service.namespace.svc,
// the last two also with .cluster.local. ok is false for a host outside
// the cluster (an IP, localhost, or a name of none of these forms).
func resolveHost(host, ns string, byKind map[string]map[string]kubeDoc) (t target, ok bool) {
	host = strings.ToLower(strings.TrimSuffix(host, "."))
	if net.ParseIP(host) != nil || host == "localhost" {
		return target{}, false
	}
	if h, found := strings.CutSuffix(host, ".cluster.local"); found && strings.HasSuffix(h, ".svc") {
		host = h
	}
	l := strings.Split(host, ".")
	switch {
	case len(l) == 1:
		t = target{svcName: l[0], ns: ns}
	case len(l) == 2 && byKind["Namespace"][l[1]].doc != nil:
		t = target{svcName: l[0], ns: l[1]}
	case len(l) == 3 && l[2] == "svc":
		t = target{svcName: l[0], ns: l[1]}
	case len(l) == 4 && l[3] == "svc":
		t = target{pod: l[0], svcName: l[1], ns: l[2]}
	default:
		return target{}, false
	}
	if d, found := byKind["Service"][t.svcName]; found && strOf(dig(d.doc, "metadata", "namespace")) == t.ns {
		t.svc = &d
	}
	return t, true
}

func (r role) labels() map[string]any {
	return mapOf(dig(r.d.doc, "spec", "template", "metadata", "labels"))
}

// mountOf returns the container's mount that file lies under (the deepest
// one), and the pod's volume it mounts.
func (r role) mountOf(file string) (mount, volume map[string]any) {
	best := ""
	for _, m := range listOf(dig(r.c, "volumeMounts")) {
		mp := strings.TrimSuffix(strOf(dig(m, "mountPath")), "/")
		if (file == mp || strings.HasPrefix(file, mp+"/")) && len(mp) >= len(best) {
			best, mount = mp, mapOf(m)
		}
	}
	if mount == nil {
		return nil, nil
	}
	for _, v := range listOf(r.pod["volumes"]) {
		if strOf(dig(v, "name")) == strOf(mount["name"]) {
			return mount, mapOf(v)
		}
	}
	return mount, nil
}

// fileSecret is the Secret the file of variable v is from, or "".
func (r role) fileSecret(v string) string {
	m, vol := r.mountOf(r.env[v])
	if m == nil {
		return ""
	}
	secret, _, _ := secretFile(m, vol, r.env[v])
	return secret
}

// secretFile returns the Secret a mounted file comes from and its key in
// it; projected is false if the volume's items leave the file out. A file
// on another kind of volume is projected, from no Secret.
func secretFile(mount, volume map[string]any, file string) (secret, key string, projected bool) {
	secret = strOf(dig(volume, "secret", "secretName"))
	if secret == "" {
		return "", "", true
	}
	mp := strings.TrimSuffix(strOf(mount["mountPath"]), "/")
	rel := strings.TrimPrefix(file, mp+"/")
	if file == mp {
		rel = ""
	}
	if sub := strOf(mount["subPath"]); sub != "" {
		rel = path.Join(sub, rel)
	}
	items := listOf(dig(volume, "secret", "items"))
	if len(items) == 0 {
		return secret, rel, true
	}
	for _, it := range items {
		if strOf(dig(it, "path")) == rel {
			return secret, strOf(dig(it, "key")), true
		}
	}
	return secret, "", false
}

// certificateOf is the Certificate whose Secret is secret, or nil.
func certificateOf(byKind map[string]map[string]kubeDoc, secret string) *kubeDoc {
	if secret == "" {
		return nil
	}
	for _, name := range sortedKeys(byKind["Certificate"]) {
		if d := byKind["Certificate"][name]; strOf(dig(d.doc, "spec", "secretName")) == secret {
			return &d
		}
	}
	return nil
}

// issuerOf is a Certificate's issuerRef: kind (Issuer unless said) and
// name.
func issuerOf(cert kubeDoc) (kind, name string) {
	kind = strOf(dig(cert.doc, "spec", "issuerRef", "kind"))
	if kind == "" {
		kind = "Issuer"
	}
	return kind, strOf(dig(cert.doc, "spec", "issuerRef", "name"))
}

// trustedIssuers are the issuers ("Issuer/name") whose certificates the
// CA in ca's Secret verifies: its own issuer's (ca.crt of an issued
// certificate), or for a CA certificate the Issuers signing with it.
func trustedIssuers(ca kubeDoc, byKind map[string]map[string]kubeDoc) []string {
	if dig(ca.doc, "spec", "isCA") != true {
		kind, name := issuerOf(ca)
		return []string{kind + "/" + name}
	}
	var out []string
	for _, name := range sortedKeys(byKind["Issuer"]) {
		if strOf(dig(byKind["Issuer"][name].doc, "spec", "ca", "secretName")) == strOf(dig(ca.doc, "spec", "secretName")) {
			out = append(out, "Issuer/"+name)
		}
	}
	return out
}

// dnsNameCovers reports whether a certificate's DNS name covers host: the
// same name, or a wildcard for one leftmost label.
func dnsNameCovers(name, host string) bool {
	name, host = strings.ToLower(name), strings.ToLower(host)
	if rest, ok := strings.CutPrefix(name, "*."); ok {
		label, hostRest, found := strings.Cut(host, ".")
		return found && label != "" && hostRest == rest
	}
	return name == host
}

// loopback reports whether a listen address is on loopback only.
func loopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	ip := net.ParseIP(host)
	return host == "localhost" || ip != nil && ip.IsLoopback()
}
