package policy

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/fstest"
	"time"

	"github.com/cedar-policy/cedar-go"
	"github.com/google/go-cmp/cmp"

	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
)

// load builds a set from in-memory files.
func load(t testing.TB, label string, files map[string]string) *Set {
	t.Helper()
	s, err := LoadFS(mapFS(files), label)
	if err != nil {
		t.Fatalf("LoadFS(%s) error = %v", label, err)
	}
	return s
}

func mapFS(files map[string]string) fstest.MapFS {
	m := fstest.MapFS{}
	for n, c := range files {
		m[n] = &fstest.MapFile{Data: []byte(c)}
	}
	return m
}

func newEngine(t testing.TB, cfg Config) *Engine {
	t.Helper()
	e, err := NewEngine(cfg)
	if err != nil {
		t.Fatalf("NewEngine() error = %v", err)
	}
	return e
}

const allowWeather = `
@id("weather")
permit (principal, action == Action::"tool::get_weather", resource);
`

const forbidWeather = `
@id("no-weather")
forbid (principal, action == Action::"tool::get_weather", resource);
@id("weather")
permit (principal, action == Action::"tool::get_weather", resource);
`

func TestEvaluationErrorsDeny(t *testing.T) {
	cases := []struct {
		name   string
		policy string
		want   []string
	}{
		{
			name: "missing attribute in a permit",
			policy: `@id("broken") permit (principal, action, resource)
				when { context.arguments.no_such_argument == 1 };`,
			want: []string{"broken"},
		},
		{
			name: "type error in a permit",
			policy: `@id("broken") permit (principal, action, resource)
				when { context.tool > 3 };`,
			want: []string{"broken"},
		},
		{
			name: "error in a forbid next to a matching permit",
			policy: allowWeather + `@id("broken-forbid") forbid (principal, action, resource)
				when { resource.no_such_attribute == "x" };`,
			want: []string{"broken-forbid"},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := load(t, "v1", map[string]string{"p.cedar": tc.policy})
			var logs bytes.Buffer
			e := newEngine(t, Config{Set: s, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
			got := e.Decide(context.Background(), simple("get_weather"))
			want := Decision{Reason: ReasonPolicyError, PolicyIDs: tc.want, Version: s.Version()}
			if diff := cmp.Diff(want, got, decisionOpts); diff != "" {
				t.Errorf("Decide() mismatch (-want +got):\n%s", diff)
			}
			if !strings.Contains(got.Detail, "p.cedar:") {
				t.Errorf("Detail = %q, want the file and position of the failing policy", got.Detail)
			}
			if !strings.Contains(logs.String(), "policy evaluation failed") {
				t.Errorf("logs = %q, want the failure logged", logs.String())
			}
		})
	}
}

// steppingClock advances by step on every reading.
type steppingClock struct {
	mu   sync.Mutex
	t    time.Time
	step time.Duration
}

func (c *steppingClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(c.step)
	return c.t
}

func TestTimeoutDenies(t *testing.T) {
	s := load(t, "v1", map[string]string{"p.cedar": allowWeather})
	expired, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel()
	cases := []struct {
		name  string
		cfg   Config
		hook  func(cedar.PolicyID)
		ctx   context.Context
		alive bool // the same engine decides normally without the slowness
	}{
		{
			name: "clock passes the timeout during evaluation",
			cfg:  Config{Set: s, Now: (&steppingClock{t: at, step: time.Second}).Now},
			ctx:  context.Background(),
		},
		{
			name: "1ns timeout with a slow policy",
			cfg:  Config{Set: s, Timeout: time.Nanosecond},
			hook: func(cedar.PolicyID) {
				// Busy for a microsecond: slow, without sleeping.
				for start := time.Now(); time.Since(start) < time.Microsecond; {
				}
			},
			ctx: context.Background(),
		},
		{
			name:  "caller's context already past its deadline",
			cfg:   Config{Set: s},
			ctx:   expired,
			alive: true,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newEngine(t, tc.cfg)
			e.hook = tc.hook
			got := e.Decide(tc.ctx, simple("get_weather"))
			want := Decision{Reason: ReasonPolicyTimeout, Version: s.Version()}
			if diff := cmp.Diff(want, got, decisionOpts); diff != "" {
				t.Errorf("Decide() mismatch (-want +got):\n%s", diff)
			}
			if tc.alive {
				if got := e.Decide(context.Background(), simple("get_weather")); !got.Allow {
					t.Errorf("Decide() with a live context = %+v, want allowed", got)
				}
			}
		})
	}
}

func TestPanicIsRecoveredAsDenial(t *testing.T) {
	s := load(t, "v1", map[string]string{"p.cedar": allowWeather})
	var logs bytes.Buffer
	e := newEngine(t, Config{Set: s, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	var panicking atomic.Bool
	panicking.Store(true)
	e.hook = func(cedar.PolicyID) {
		if panicking.Load() {
			panic("evaluator bug")
		}
	}
	got := e.Decide(context.Background(), simple("get_weather"))
	want := Decision{Reason: ReasonPolicyError, Version: s.Version()}
	if diff := cmp.Diff(want, got, decisionOpts); diff != "" {
		t.Errorf("Decide() mismatch (-want +got):\n%s", diff)
	}
	if !strings.Contains(logs.String(), "policy evaluation panicked") {
		t.Errorf("logs = %q, want the panic logged", logs.String())
	}
	panicking.Store(false)
	if got := e.Decide(context.Background(), simple("get_weather")); !got.Allow {
		t.Errorf("Decide() after the panic = %+v, want allowed", got)
	}
}

func TestNoActiveSetDenies(t *testing.T) {
	e := newEngine(t, Config{})
	got := e.Decide(context.Background(), simple("get_weather"))
	if diff := cmp.Diff(Decision{Reason: ReasonUnavailable}, got, decisionOpts); diff != "" {
		t.Errorf("Decide() mismatch (-want +got):\n%s", diff)
	}
}

func TestNewEngineRejectsNegativeTimeout(t *testing.T) {
	if _, err := NewEngine(Config{Timeout: -time.Second}); err == nil {
		t.Errorf("NewEngine(Timeout: -1s) error = nil, want an error")
	}
}

func TestSwapTakesEffectForNextDecide(t *testing.T) {
	a := load(t, "v1", map[string]string{"p.cedar": allowWeather})
	b := load(t, "v2", map[string]string{"p.cedar": forbidWeather})
	e := newEngine(t, Config{Set: a})

	got := e.Decide(context.Background(), simple("get_weather"))
	want := Decision{Allow: true, Reason: ReasonAllowed, PolicyIDs: []string{"weather"}, Version: a.Version()}
	if diff := cmp.Diff(want, got, decisionOpts); diff != "" {
		t.Errorf("Decide() before swap mismatch (-want +got):\n%s", diff)
	}
	if old := e.Swap(b); old != a {
		t.Errorf("Swap() = %v, want the previous set %v", old, a)
	}
	if e.Active() != b {
		t.Errorf("Active() = %v, want %v", e.Active(), b)
	}
	got = e.Decide(context.Background(), simple("get_weather"))
	want = Decision{Reason: ReasonDeniedByPolicy, PolicyIDs: []string{"no-weather"}, Version: b.Version()}
	if diff := cmp.Diff(want, got, decisionOpts); diff != "" {
		t.Errorf("Decide() after swap mismatch (-want +got):\n%s", diff)
	}
	if a.Version() == b.Version() {
		t.Errorf("versions of different sets are equal: %s", a.Version())
	}
}

// TestConcurrentDecideAndSwap runs under -race: decisions in flight while
// sets are swapped always come from one whole set.
func TestConcurrentDecideAndSwap(t *testing.T) {
	a := load(t, "v1", map[string]string{"p.cedar": allowWeather})
	b := load(t, "v2", map[string]string{"p.cedar": forbidWeather})
	// A budget no stall reaches: with 8 deciders on a loaded machine the
	// default 50ms timed out now and then (policy_timeout, no allow),
	// which is not what this test is about.
	e := newEngine(t, Config{Set: a, Timeout: time.Minute})
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 8 {
		wg.Go(func() {
			for range 200 {
				d := e.Decide(context.Background(), simple("get_weather"))
				if d.Allow != (d.Version == a.Version()) {
					errs <- fmt.Errorf("decision %+v does not match its version", d)
					return
				}
			}
		})
	}
	for i := range 200 {
		if i%2 == 0 {
			e.Swap(b)
		} else {
			e.Swap(a)
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// writeFile replaces dir/name by a rename, as a deployment should, so that
// a watcher never reads it half-written.
func writeFile(t *testing.T, dir, name, content string) {
	t.Helper()
	tmp := filepath.Join(dir, "."+name+".tmp")
	if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, name)); err != nil {
		t.Fatal(err)
	}
}

func TestReload(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, dir, "weather.cedar", allowWeather)
	e := newEngine(t, Config{})
	if err := e.Reload(dir, "v1"); err != nil {
		t.Fatalf("Reload(v1) error = %v", err)
	}
	v1 := e.Active()
	if got := e.Decide(context.Background(), simple("get_weather")); !got.Allow || got.Version != v1.Version() {
		t.Fatalf("Decide() after reload = %+v, want allowed by %s", got, v1.Version())
	}

	// The same files again: nothing changes.
	if err := e.Reload(dir, "v1"); err != nil {
		t.Fatalf("Reload(v1) again error = %v", err)
	}
	if e.Active() != v1 {
		t.Errorf("Reload() of unchanged files replaced the active set")
	}

	// A broken file keeps the old version active.
	writeFile(t, dir, "zz_broken.cedar", "permit (principal, action, resource\n  when { true };")
	err := e.Reload(dir, "v2")
	var pe *ParseError
	if !errors.As(err, &pe) {
		t.Fatalf("Reload(broken) error = %v, want a *ParseError", err)
	}
	if pe.File != "zz_broken.cedar" || !regexp.MustCompile(`:\d+:\d+`).MatchString(err.Error()) {
		t.Errorf("Reload(broken) error = %q, want the file name and a line:column", err)
	}
	if e.Active() != v1 {
		t.Errorf("Active() = %v after a broken reload, want %v", e.Active(), v1)
	}
	if got := e.Decide(context.Background(), simple("get_weather")); !got.Allow || got.Version != v1.Version() {
		t.Errorf("Decide() after broken reload = %+v, want allowed by %s", got, v1.Version())
	}

	// Fixed: the new version takes over.
	writeFile(t, dir, "zz_broken.cedar", `@id("no-weather") forbid (principal, action == Action::"tool::get_weather", resource);`)
	if err := e.Reload(dir, "v2"); err != nil {
		t.Fatalf("Reload(v2) error = %v", err)
	}
	got := e.Decide(context.Background(), simple("get_weather"))
	if got.Allow || got.Reason != ReasonDeniedByPolicy || got.Version != e.Active().Version() || !strings.HasPrefix(got.Version, "v2@") {
		t.Errorf("Decide() after reload v2 = %+v, want denied_by_policy by v2", got)
	}
}

func TestLoadErrors(t *testing.T) {
	cases := []struct {
		name  string
		files map[string]string
		label string
		want  error
	}{
		{name: "no policy files", files: map[string]string{"README.md": "x"}, label: "v1", want: ErrNoPolicies},
		{name: "empty label", files: map[string]string{"p.cedar": allowWeather}, label: "", want: ErrInvalidSet},
		{name: "label with @", files: map[string]string{"p.cedar": allowWeather}, label: "v1@x", want: ErrInvalidSet},
		{
			name:  "duplicate id across files",
			files: map[string]string{"a.cedar": allowWeather, "b.cedar": allowWeather},
			label: "v1", want: ErrInvalidSet,
		},
		{name: "empty id", files: map[string]string{"p.cedar": `@id("") permit (principal, action, resource);`}, label: "v1", want: ErrInvalidSet},
		{name: "unknown obligation", files: map[string]string{"p.cedar": `@obligation("require_aproval") permit (principal, action, resource);`}, label: "v1", want: ErrInvalidSet},
		{name: "empty obligation", files: map[string]string{"p.cedar": `@obligation permit (principal, action, resource);`}, label: "v1", want: ErrInvalidSet},
		{name: "empty mask", files: map[string]string{"p.cedar": `@mask(" , ") permit (principal, action, resource);`}, label: "v1", want: ErrInvalidSet},
		{name: "mask of the whole result", files: map[string]string{"p.cedar": `@mask("/") permit (principal, action, resource);`}, label: "v1", want: ErrInvalidSet},
		{name: "rate limit without unit", files: map[string]string{"p.cedar": `@rate_limit("20") permit (principal, action, resource);`}, label: "v1", want: ErrInvalidSet},
		{name: "rate limit bad unit", files: map[string]string{"p.cedar": `@rate_limit("20/d") permit (principal, action, resource);`}, label: "v1", want: ErrInvalidSet},
		{name: "rate limit zero", files: map[string]string{"p.cedar": `@rate_limit("0/m") permit (principal, action, resource);`}, label: "v1", want: ErrInvalidSet},
		{name: "rate limit huge", files: map[string]string{"p.cedar": `@rate_limit("99999999999/s") permit (principal, action, resource);`}, label: "v1", want: ErrInvalidSet},
		{name: "rate limit by whom unknown", files: map[string]string{"p.cedar": `@rate_limit("20/m by tool") permit (principal, action, resource);`}, label: "v1", want: ErrInvalidSet},
		{name: "rate limit by nobody", files: map[string]string{"p.cedar": `@rate_limit("20/m by") permit (principal, action, resource);`}, label: "v1", want: ErrInvalidSet},
		{name: "rate limit by user twice", files: map[string]string{"p.cedar": `@rate_limit("20/m by user by user") permit (principal, action, resource);`}, label: "v1", want: ErrInvalidSet},
		{name: "sandbox bad value", files: map[string]string{"p.cedar": `@sandbox("yes") permit (principal, action, resource);`}, label: "v1", want: ErrInvalidSet},
		// An obligation under a name the engine does not read would be
		// ignored, the rule a plain allow.
		{name: "obligation as an annotation of its own", files: map[string]string{"p.cedar": `@require_approval permit (principal, action, resource);`}, label: "v1", want: ErrInvalidSet},
		{name: "rate limit misspelt", files: map[string]string{"p.cedar": `@ratelimit("20/m") permit (principal, action, resource);`}, label: "v1", want: ErrInvalidSet},
		{name: "unknown annotation on a forbid", files: map[string]string{"p.cedar": `@obligations("require_approval") forbid (principal, action, resource);`}, label: "v1", want: ErrInvalidSet},
		// Redact would drop it, masking nothing.
		{name: "mask with a bad escape", files: map[string]string{"p.cedar": `@mask("/card~number") permit (principal, action, resource);`}, label: "v1", want: ErrInvalidSet},
		{name: "limit spelt in capitals", files: map[string]string{"p.cedar": `@Rate_Limit("20/m") permit (principal, action, resource);`}, label: "v1", want: ErrInvalidSet},
		{name: "masks", files: map[string]string{"p.cedar": `@masks("/pin") permit (principal, action, resource);`}, label: "v1", want: ErrInvalidSet},
		// Any other annotation is a note for the policy's readers.
		{name: "notes", files: map[string]string{"p.cedar": `@id("p") @description("weather for all") @owner("platform") @reason("PCI") @author("a") @advice("x") @version("3") @generated("g") @undocumented("u") @mask("/card~1number") permit (principal, action, resource);`}, label: "v1"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s, err := LoadFS(mapFS(tc.files), tc.label)
			if !errors.Is(err, tc.want) {
				t.Errorf("LoadFS() = %v, %v; want error %v", s, err, tc.want)
			}
		})
	}
}

func TestParseErrorNamesFileAndPosition(t *testing.T) {
	_, err := LoadFS(mapFS(map[string]string{
		"good.cedar": allowWeather,
		"bad.cedar":  "permit (principal, action, resource);\n\npermit (principal, actoin, resource);",
	}), "v1")
	var pe *ParseError
	if !errors.As(err, &pe) {
		t.Fatalf("LoadFS() error = %v, want a *ParseError", err)
	}
	if pe.File != "bad.cedar" || !strings.Contains(err.Error(), "bad.cedar") || !strings.Contains(err.Error(), ":3:") {
		t.Errorf("LoadFS() error = %q, want file bad.cedar and line 3", err)
	}
}

func TestVersionAndHash(t *testing.T) {
	files := map[string]string{"a.cedar": allowWeather, "b.cedar": forbidWeather[strings.Index(forbidWeather, "@id"):strings.Index(forbidWeather, "@id(\"weather")]}
	base := load(t, "v41", files)

	if !regexp.MustCompile(`^sha256:[0-9a-f]{64}$`).MatchString(base.Hash()) {
		t.Errorf("Hash() = %q, want sha256:<64 hex>", base.Hash())
	}
	if want := "v41@" + base.Hash()[len("sha256:"):][:12]; base.Version() != want {
		t.Errorf("Version() = %q, want %q", base.Version(), want)
	}

	// The same files from two directories on disk hash the same.
	var dirs []string
	for range 2 {
		dir := t.TempDir()
		for n, c := range files {
			writeFile(t, dir, n, c)
		}
		dirs = append(dirs, dir)
	}
	for _, dir := range dirs {
		s, err := LoadDir(dir, "v41")
		if err != nil {
			t.Fatalf("LoadDir() error = %v", err)
		}
		if s.Hash() != base.Hash() || s.Version() != base.Version() {
			t.Errorf("LoadDir(%s) = %s %s, want %s %s", dir, s.Hash(), s.Version(), base.Hash(), base.Version())
		}
	}

	// Non-policy files do not count.
	withReadme := map[string]string{"README.md": "notes"}
	for n, c := range files {
		withReadme[n] = c
	}
	if got := load(t, "v41", withReadme).Hash(); got != base.Hash() {
		t.Errorf("Hash() with a README = %s, want %s", got, base.Hash())
	}

	changes := []struct {
		name  string
		files map[string]string
	}{
		{name: "content changed", files: map[string]string{"a.cedar": allowWeather + "\n", "b.cedar": files["b.cedar"]}},
		{name: "file renamed", files: map[string]string{"a2.cedar": allowWeather, "b.cedar": files["b.cedar"]}},
		{name: "text moved between files", files: map[string]string{"a.cedar": allowWeather + files["b.cedar"], "b.cedar": ""}},
		{name: "file added", files: map[string]string{"a.cedar": allowWeather, "b.cedar": files["b.cedar"], "c.cedar": "// nothing\n"}},
	}
	for _, tc := range changes {
		t.Run(tc.name, func(t *testing.T) {
			if got := load(t, "v41", tc.files); got.Hash() == base.Hash() || got.Version() == base.Version() {
				t.Errorf("Hash() = %s, want it to differ from %s", got.Hash(), base.Hash())
			}
		})
	}
}

func TestDemoMatchesItsFilesOnDisk(t *testing.T) {
	demo, err := Demo()
	if err != nil {
		t.Fatalf("Demo() error = %v", err)
	}
	if demo.Label() != DemoLabel || !strings.HasPrefix(demo.Version(), "demo@") {
		t.Errorf("Demo() label/version = %s %s", demo.Label(), demo.Version())
	}
	disk, err := LoadDir("demo", DemoLabel)
	if err != nil {
		t.Fatalf("LoadDir(demo) error = %v", err)
	}
	if disk.Hash() != demo.Hash() {
		t.Errorf("LoadDir(demo).Hash() = %s, want the embedded set's %s", disk.Hash(), demo.Hash())
	}
	wantIDs := []string{
		"email-external-needs-approval", "email-internal", "read-tools", "refund-cap", "refund-compensation",
		"refund-large-needs-approval", "refund-small", "tenant-isolation",
	}
	if diff := cmp.Diff(wantIDs, demo.PolicyIDs()); diff != "" {
		t.Errorf("Demo().PolicyIDs() mismatch (-want +got):\n%s", diff)
	}
}

func TestObligationsOnlyFromDecidingPolicies(t *testing.T) {
	s := load(t, "v1", map[string]string{"p.cedar": `
// Matches: its obligations apply.
@id("match-mask")
@mask("/b, /a")
@rate_limit("1000/h")
permit (principal, action == Action::"tool::get_weather", resource);

// Matches too: masks add up, both rate limits apply.
@id("match-sandbox")
@mask("/a,/c")
@rate_limit("5/m")
@sandbox("false")
permit (principal, action == Action::"tool::get_weather", resource)
when { context.channel == "api" };

// Does not match: its annotations must not leak into the decision.
@id("other-action")
@obligation("require_approval")
@mask("/secret")
@rate_limit("1/h")
permit (principal, action == Action::"tool::send_email", resource);

// Does not match either.
@id("never")
@obligation("require_approval")
permit (principal, action == Action::"tool::get_weather", resource)
when { context.channel == "carrier_pigeon" };

// A forbid that does not match, annotated for good measure; its mask
// still hides the field in every create_ticket audit copy.
@id("forbid-night")
@obligation("sandbox")
forbid (principal, action, resource) when { context.hour < 6 };

// No @id: named after its file and place.
permit (principal, action == Action::"tool::create_ticket", resource);
`, "q.cedar": `
@id("forbid-urgent")
@mask("body")
forbid (principal, action in [Action::"tool::create_ticket", Action::"tool::send_email"], resource)
when { context.arguments has priority && context.arguments.priority == "urgent" };
`})
	e := newEngine(t, Config{Set: s})
	// Every get_weather decision hides what either get_weather permit
	// masks, matching or not; send_email's permit is another tool's.
	weatherMasks := []string{"/a", "/b", "/c"}
	cases := []struct {
		name string
		req  Request
		want Decision
	}{
		{
			name: "two matching permits add up",
			req:  simple("get_weather"),
			want: Decision{Allow: true, Reason: ReasonAllowed, PolicyIDs: []string{"match-mask", "match-sandbox"}, Version: s.Version(),
				Obligations: Obligations{Mask: []string{"/a", "/b", "/c"}, RateLimits: []RateLimit{{N: 1000, Per: time.Hour, Policy: "match-mask"}, {N: 5, Per: time.Minute, Policy: "match-sandbox"}}},
				AuditMask:   weatherMasks},
		},
		{
			name: "one matching permit",
			req:  func() Request { r := simple("get_weather"); r.Channel = "agent"; return r }(),
			want: Decision{Allow: true, Reason: ReasonAllowed, PolicyIDs: []string{"match-mask"}, Version: s.Version(),
				Obligations: Obligations{Mask: []string{"/a", "/b"}, RateLimits: []RateLimit{{N: 1000, Per: time.Hour, Policy: "match-mask"}}},
				AuditMask:   weatherMasks},
		},
		{
			name: "policy without @id keeps cedar's name",
			req:  simple("create_ticket"),
			want: Decision{Allow: true, Reason: ReasonAllowed, PolicyIDs: []string{"p.cedar:policy5"}, Version: s.Version(),
				AuditMask: []string{"body"}},
		},
		{
			name: "denial carries no obligations, but the audit mask of every policy for the tool",
			req:  func() Request { r := simple("get_weather"); r.Time = at.Add(-10 * time.Hour); return r }(),
			want: Decision{Reason: ReasonDeniedByPolicy, PolicyIDs: []string{"forbid-night"}, Version: s.Version(), AuditMask: weatherMasks},
		},
		{
			name: "a forbid's mask hides its field when it denies",
			req: func() Request {
				r := simple("create_ticket")
				r.Arguments = map[string]any{"priority": "urgent"}
				return r
			}(),
			want: Decision{Reason: ReasonDeniedByPolicy, PolicyIDs: []string{"forbid-urgent"}, Version: s.Version(), AuditMask: []string{"body"}},
		},
		{
			name: "no policy masks anything for the tool",
			req:  simple("drop_database"),
			want: Decision{Reason: ReasonNoPolicy, Version: s.Version()},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := e.Decide(context.Background(), tc.req)
			if diff := cmp.Diff(tc.want, got, decisionOpts); diff != "" {
				t.Errorf("Decide() mismatch (-want +got):\n%s", diff)
			}
		})
	}
}

// The audit mask of a tool is read from the action scopes when the set
// loads: a scope that names no action counts for every tool. (One that
// names no tool's action does not load: TestScopeNoCallMatches.)
func TestAuditMaskByActionScope(t *testing.T) {
	s := load(t, "v1", map[string]string{"p.cedar": `
@mask("eq") permit (principal, action == Action::"tool::a", resource);
@mask("in-one") permit (principal, action in Action::"tool::b", resource);
@mask("in-list") forbid (principal, action in [Action::"tool::a", Action::"tool::c"], resource);
@mask("any") forbid (principal, action, resource) when { context.tool == "a" };
`})
	cases := []struct {
		tool string
		want []string
	}{
		{"a", []string{"any", "eq", "in-list"}},
		{"b", []string{"any", "in-one"}},
		{"c", []string{"any", "in-list"}},
		{"unknown", []string{"any"}},
	}
	for _, tc := range cases {
		if diff := cmp.Diff(tc.want, s.auditMask(tc.tool)); diff != "" {
			t.Errorf("auditMask(%q) mismatch (-want +got):\n%s", tc.tool, diff)
		}
	}
	got := s.auditMask("a")
	got[0] = "changed"
	if s.auditMask("a")[0] != "any" {
		t.Errorf("auditMask returned the set's own slice; a caller's change reached the set")
	}
}

// Decisions that fail closed before or during evaluation carry the audit
// mask too: a timeout, an evaluation error, an invalid request.
func TestAuditMaskOnEveryDenial(t *testing.T) {
	const masked = `@id("masked") @mask("secret") permit (principal, action == Action::"tool::get_weather", resource);
`
	cases := []struct {
		name   string
		policy string
		cfg    Config
		req    Request
		reason string
	}{
		{name: "timeout", policy: masked, cfg: Config{Now: (&steppingClock{t: at, step: time.Second}).Now}, req: simple("get_weather"), reason: ReasonPolicyTimeout},
		{name: "evaluation error", policy: masked + `@id("broken") permit (principal, action, resource) when { context.no_such_attribute == 1 };`,
			req: simple("get_weather"), reason: ReasonPolicyError},
		{name: "invalid request", policy: masked, req: func() Request { r := simple("get_weather"); r.User = ""; return r }(), reason: ReasonInvalidRequest},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := tc.cfg
			cfg.Set = load(t, "v1", map[string]string{"p.cedar": tc.policy})
			got := newEngine(t, cfg).Decide(context.Background(), tc.req)
			if got.Allow || got.Reason != tc.reason || !slices.Equal(got.AuditMask, []string{"secret"}) {
				t.Errorf("Decide() = %+v; want denied (%s) with AuditMask [secret]", got, tc.reason)
			}
		})
	}
}

func TestParseObligations(t *testing.T) {
	cases := []struct {
		name string
		ann  cedar.Annotations
		want Obligations
	}{
		{name: "none", ann: cedar.Annotations{"id": "x", "description": "free text"}},
		{name: "approval", ann: cedar.Annotations{"obligation": "require_approval"}, want: Obligations{RequireApproval: true}},
		{name: "list", ann: cedar.Annotations{"obligation": " require_approval , sandbox "}, want: Obligations{RequireApproval: true, Sandbox: true}},
		{name: "bare sandbox", ann: cedar.Annotations{"sandbox": ""}, want: Obligations{Sandbox: true}},
		{name: "sandbox true", ann: cedar.Annotations{"sandbox": "true"}, want: Obligations{Sandbox: true}},
		{name: "sandbox false", ann: cedar.Annotations{"sandbox": "false"}},
		{name: "masks sorted and deduplicated", ann: cedar.Annotations{"mask": "card_number, /reason,card_number"}, want: Obligations{Mask: []string{"/reason", "card_number"}}},
		{name: "per second", ann: cedar.Annotations{"rate_limit": "3/s"}, want: Obligations{RateLimits: []RateLimit{{N: 3, Per: time.Second}}}},
		{name: "per hour", ann: cedar.Annotations{"rate_limit": "3/h"}, want: Obligations{RateLimits: []RateLimit{{N: 3, Per: time.Hour}}}},
		{name: "by user", ann: cedar.Annotations{"rate_limit": " 3/m  by user "}, want: Obligations{RateLimits: []RateLimit{{N: 3, Per: time.Minute, By: RateByUser}}}},
		{name: "by agent", ann: cedar.Annotations{"rate_limit": "3/m by agent"}, want: Obligations{RateLimits: []RateLimit{{N: 3, Per: time.Minute, By: RateByAgent}}}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseObligations(tc.ann)
			if err != nil {
				t.Fatalf("parseObligations() error = %v", err)
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("parseObligations() mismatch (-want +got):\n%s", diff)
			}
		})
	}
}

// A bare @sandbox parses, and the call its permit decides is denied
// sandbox_unavailable: no call runs against a sandbox backend, and one run
// against the real backend would escape the rule.
func TestSandboxObligationDenies(t *testing.T) {
	s := load(t, "v1", map[string]string{"p.cedar": `@id("sb") @sandbox permit (principal, action, resource);`})
	got := newEngine(t, Config{Set: s}).Decide(context.Background(), simple("get_weather"))
	if got.Allow || got.Reason != ReasonSandboxUnavailable || !slices.Equal(got.PolicyIDs, []string{"sb"}) {
		t.Errorf("Decide() = %+v; want denied sandbox_unavailable by sb", got)
	}
}

func TestObligationsList(t *testing.T) {
	o := Obligations{RequireApproval: true, Mask: []string{"/a", "b"}, Sandbox: true, RateLimits: []RateLimit{
		{N: 20, Per: time.Minute, Policy: "a"}, {N: 5, Per: time.Hour, Policy: "b"}, {N: 20, Per: time.Minute, Policy: "c"}}}
	// One entry per limit, equal ones too: each is a budget of its own.
	o.RateLimits = append(o.RateLimits, RateLimit{N: 2, Per: time.Second, By: RateByUser, Policy: "d"})
	want := []string{"require_approval", "mask:/a", "mask:b", "rate_limit:20/m", "rate_limit:5/h", "rate_limit:20/m", "rate_limit:2/s by user", "sandbox"}
	if diff := cmp.Diff(want, o.List()); diff != "" {
		t.Errorf("List() mismatch (-want +got):\n%s", diff)
	}
	if (Obligations{}).List() != nil || !(Obligations{}).IsZero() || o.IsZero() {
		t.Errorf("zero Obligations: List() = %v, IsZero() = %v; full IsZero() = %v", (Obligations{}).List(), (Obligations{}).IsZero(), o.IsZero())
	}
}

func TestContextModel(t *testing.T) {
	// Each policy checks one part of the documented model; a request that
	// fits the model matches all of them.
	s := load(t, "v1", map[string]string{"model.cedar": `
@id("principal") permit (principal == User::"t_acme/u_88", action, resource) when { principal.tenant == "t_acme" };
@id("action") permit (principal, action == Action::"tool::refund_order", resource);
@id("resource") permit (principal, action, resource == Resource::"t_acme/ord_1029") when { resource.tenant == "t_acme" && resource.kind == "object" };
@id("context") permit (principal, action, resource) when {
  context.tenant == "t_acme" && context.agent == "agent_support" && context.purpose == "customer_refund_after_dispute" &&
  context.amount == 4500 && context.has_amount && context.risk == "high" && context.effect == "external_side_effect" &&
  context.channel == "agent" && context.tool == "refund_order" && context.tool_version == 1 &&
  context.time == 1772629506 && context.hour == 13
};
@id("arguments") permit (principal, action, resource) when {
  context.arguments has order_id && context.arguments.order_id == "ord_1029" && context.arguments.amount_cents == 4500 && context.arguments.flag == true &&
  context.arguments.n == 7 && !(context.arguments has nested) && !(context.arguments has ratio) && !(context.arguments has nothing)
};
@id("tool-resource") permit (principal, action, resource == Resource::"t_acme/get_weather") when { resource.kind == "tool" && !context.has_amount && context.amount == 0 };
`})
	e := newEngine(t, Config{Set: s})
	r := refund(4500)
	r.Arguments["flag"] = true
	r.Arguments["n"] = 7
	r.Arguments["nested"] = map[string]any{"a": "b"}
	r.Arguments["ratio"] = 0.5
	r.Arguments["nothing"] = nil
	got := e.Decide(context.Background(), r)
	want := []string{"action", "arguments", "context", "principal", "resource"}
	if diff := cmp.Diff(want, got.PolicyIDs); diff != "" {
		t.Errorf("Decide(refund).PolicyIDs mismatch (-want +got):\n%s\n%s", diff, got.Detail)
	}
	got = e.Decide(context.Background(), simple("get_weather"))
	if diff := cmp.Diff([]string{"principal", "tool-resource"}, got.PolicyIDs); diff != "" {
		t.Errorf("Decide(get_weather).PolicyIDs mismatch (-want +got):\n%s\n%s", diff, got.Detail)
	}
}

// With Config.Roles the principal has the caller's roles, and the
// decision records them (sorted, once each); without it a policy that
// reads them fails closed, and `has` says they are not there.
func TestPrincipalRoles(t *testing.T) {
	s := load(t, "v1", map[string]string{"roles.cedar": `
@id("finance") permit (principal, action == Action::"tool::get_weather", resource) when { principal.roles.contains("finance") };
`})
	guarded := load(t, "v2", map[string]string{"roles.cedar": `
@id("weather") permit (principal, action == Action::"tool::get_weather", resource);
@id("no-contractors") forbid (principal, action, resource) when { principal has roles && principal.roles.contains("contractor") };
`})
	with := func(roles ...string) Request {
		r := simple("get_weather")
		r.Roles = roles
		return r
	}
	on := newEngine(t, Config{Set: s, Roles: true})
	for _, tc := range []struct {
		roles     []string
		allow     bool
		wantRoles []string
	}{
		{[]string{"support", "finance", "support"}, true, []string{"finance", "support"}},
		{[]string{"support"}, false, []string{"support"}},
		{nil, false, nil},
	} {
		d := on.Decide(t.Context(), with(tc.roles...))
		if d.Allow != tc.allow || !slices.Equal(d.Roles, tc.wantRoles) {
			t.Errorf("with roles, Decide(roles %q) = allow %v (%s) roles %q; want allow %v roles %q", tc.roles, d.Allow, d.Reason, d.Roles, tc.allow, tc.wantRoles)
		}
	}
	off := newEngine(t, Config{Set: s})
	if d := off.Decide(t.Context(), with("finance")); d.Allow || d.Reason != ReasonPolicyError || d.Roles != nil {
		t.Errorf("without roles, Decide(finance) = allow %v (%s) roles %q; want a policy_error denial, no roles", d.Allow, d.Reason, d.Roles)
	}
	off.Swap(guarded)
	if d := off.Decide(t.Context(), with("contractor")); !d.Allow {
		t.Errorf("without roles, Decide(contractor) under a guarded forbid = %s; want allowed (principal has no roles)", d.Reason)
	}
	on.Swap(guarded)
	if d := on.Decide(t.Context(), with("contractor")); d.Allow || d.Reason != ReasonDeniedByPolicy {
		t.Errorf("with roles, Decide(contractor) under a guarded forbid = allow %v (%s); want denied", d.Allow, d.Reason)
	}
	// A request that withholds roles (a call decided again that was
	// decided without them) gets no roles attribute, given or not.
	on.Swap(s)
	withheld := with("finance")
	withheld.RolesWithheld = true
	if d := on.Decide(t.Context(), withheld); d.Allow || d.Reason != ReasonPolicyError || d.Roles != nil || d.RolesGiven {
		t.Errorf("with roles, Decide(finance, withheld) = allow %v (%s) roles %q given %v; want a policy_error denial, no roles", d.Allow, d.Reason, d.Roles, d.RolesGiven)
	}
	if d := on.Decide(t.Context(), with()); !d.RolesGiven {
		t.Error("with roles, Decide(no roles) says none were given; want given (an empty set)")
	}
}

// eventually polls cond until it holds or a deadline passes.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		runtime.Gosched()
	}
}

func TestWatchDir(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, dir, "weather.cedar", allowWeather)
	first, err := LoadDir(dir, "live")
	if err != nil {
		t.Fatal(err)
	}
	logs := &ledgertest.LogBuffer{}
	e := newEngine(t, Config{Set: first, Logger: slog.New(slog.NewTextHandler(logs, nil))})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.WatchDir(ctx, dir, "live", time.Millisecond) }()

	writeFile(t, dir, "weather.cedar", forbidWeather)
	eventually(t, "the changed directory to be activated", func() bool { return e.Active() != first })
	second := e.Active()
	if got := e.Decide(context.Background(), simple("get_weather")); got.Allow || got.Version != second.Version() {
		t.Errorf("Decide() after the watcher reloaded = %+v, want denied by %s", got, second.Version())
	}

	writeFile(t, dir, "weather.cedar", "forbid (principal, action")
	eventually(t, "the broken directory to be reported", func() bool {
		return strings.Contains(logs.String(), "policy reload failed")
	})
	if e.Active() != second {
		t.Errorf("Active() = %v after a broken file, want %v kept", e.Active(), second)
	}

	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("WatchDir() = %v, want nil after cancel", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("WatchDir did not return after its context ended")
	}
}

func TestWatchDirRejectsBadInterval(t *testing.T) {
	e := newEngine(t, Config{})
	if err := e.WatchDir(context.Background(), t.TempDir(), "x", 0); err == nil {
		t.Errorf("WatchDir(every=0) = nil, want an error")
	}
}

// TestNoArgumentValuesLeak puts a canary in the arguments and checks that
// no output of this package shows it: formatted requests and decisions,
// logs of every level and format, and error details.
func TestNoArgumentValuesLeak(t *testing.T) {
	const canary = "CANARY-4f1c-secret-token-value"
	s := load(t, "v1", map[string]string{"p.cedar": `
@id("type-error") permit (principal, action, resource) when { context.arguments.card_number > 5 };
@id("like") permit (principal, action, resource) when { context.arguments.to like "*@example.com" };
`})
	logs := &ledgertest.LogBuffer{}
	h := slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})
	e := newEngine(t, Config{Set: s, Logger: slog.New(h)})
	e.hook = func(id cedar.PolicyID) {
		if id == "like" {
			panic("boom")
		}
	}

	r := email(canary + "@example.com")
	r.Arguments["card_number"] = canary
	r.Arguments["nested"] = map[string]any{"token": canary}
	panicked := e.Decide(context.Background(), r)
	e.hook = nil
	failed := e.Decide(context.Background(), r)
	if failed.Reason != ReasonPolicyError || panicked.Reason != ReasonPolicyError {
		t.Fatalf("Decide() reasons = %s, %s; want policy_error twice", failed.Reason, panicked.Reason)
	}

	var out bytes.Buffer
	fmt.Fprintf(&out, "%v %+v %#v %s %q\n", r, r, r, r, r)
	fmt.Fprintf(&out, "%v %+v %#v\n", failed, failed, panicked)
	slog.New(slog.NewTextHandler(&out, nil)).Info("request", "request", r)
	slog.New(slog.NewJSONHandler(&out, nil)).Info("request", "request", r)
	out.WriteString(logs.String())
	if strings.Contains(out.String(), canary) {
		t.Errorf("canary leaked:\n%s", out.String())
	}
	if !strings.Contains(out.String(), "card_number") {
		t.Errorf("output lacks even the argument names:\n%s", out.String())
	}
}

// TestWatchDirLoadsOnlySettledContent: a content is loaded only when two
// polls in a row read it, so a file caught mid-write (the empty file an
// editor's truncate leaves, say) is never activated.
func TestWatchDirLoadsOnlySettledContent(t *testing.T) {
	var w settle
	for i, step := range []struct {
		hash string
		load bool
	}{
		{"a", false}, // first sight
		{"a", true},  // held still
		{"a", true},  // still the same: reload no-ops on the active hash
		{"", false},  // truncated mid-write
		{"b", false}, // written, not yet seen twice
		{"b", true},
	} {
		if got := w.settled(step.hash); got != step.load {
			t.Errorf("poll %d (%q): settled = %v; want %v", i, step.hash, got, step.load)
		}
	}
}

// The denials of an engine that could not decide are transient: a caller
// may ask again later. The policies' own answers are not.
func TestTransientDenials(t *testing.T) {
	ok := load(t, "v1", map[string]string{"p.cedar": allowWeather})
	forbids := load(t, "v2", map[string]string{"p.cedar": forbidWeather})
	broken := load(t, "v3", map[string]string{"p.cedar": `@id("broken") permit (principal, action, resource)
		when { context.arguments.no_such_argument == 1 };`})
	otherTenant := simple("get_weather")
	otherTenant.ResourceTenant = "t_other"
	for _, tc := range []struct {
		name      string
		cfg       Config
		req       Request
		reason    string
		transient bool
	}{
		{"timeout", Config{Set: ok, Now: (&steppingClock{t: at, step: time.Second}).Now}, simple("get_weather"), ReasonPolicyTimeout, true},
		{"evaluation error, every time it is asked", Config{Set: broken}, simple("get_weather"), ReasonPolicyError, false},
		{"no active set", Config{}, simple("get_weather"), ReasonUnavailable, true},
		{"forbidden", Config{Set: forbids}, simple("get_weather"), ReasonDeniedByPolicy, false},
		{"no permit", Config{Set: ok}, simple("send_email"), ReasonNoPolicy, false},
		{"another tenant's resource", Config{Set: ok}, otherTenant, ReasonCrossTenant, false},
		{"invalid request", Config{Set: ok}, Request{Tool: "get_weather"}, ReasonInvalidRequest, false},
		{"allowed", Config{Set: ok}, simple("get_weather"), ReasonAllowed, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newEngine(t, tc.cfg).Decide(context.Background(), tc.req)
			if d.Reason != tc.reason || d.Transient() != tc.transient {
				t.Errorf("Decide() = %s, transient %t; want %s, transient %t", d.Reason, d.Transient(), tc.reason, tc.transient)
			}
		})
	}
}

// A policy that fails on an argument's value (an ip() that does not
// parse) denies without the value in the decision's detail, which goes
// into the call's events, or in the warning logged: Cedar's message
// quotes it, and it may be a field the registry or a policy masks. The
// message is logged at Debug only.
func TestEvaluationErrorsKeepArgumentsOut(t *testing.T) {
	const secret = "s3cr3t-4f9a"
	s := load(t, "v1", map[string]string{"p.cedar": `@id("by-ip") permit (principal, action, resource)
		when { ip(context.arguments.city).isLoopback() };`})
	var logs bytes.Buffer
	e := newEngine(t, Config{Set: s, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	req := simple("get_weather")
	req.Arguments = map[string]any{"city": secret}
	got := e.Decide(context.Background(), req)
	if got.Reason != ReasonPolicyError || !strings.Contains(got.Detail, "p.cedar:") {
		t.Fatalf("Decide() = %s, %q; want %s naming where the policy failed", got.Reason, got.Detail, ReasonPolicyError)
	}
	if strings.Contains(got.Detail, secret) || strings.Contains(logs.String(), secret) {
		t.Errorf("the argument's value is in the detail %q or the log:\n%s", got.Detail, logs.String())
	}
	var debug bytes.Buffer
	e = newEngine(t, Config{Set: s, Logger: slog.New(slog.NewTextHandler(&debug, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	e.Decide(context.Background(), req)
	if !strings.Contains(debug.String(), "policy evaluation errors") || !strings.Contains(debug.String(), "p.cedar:") {
		t.Errorf("no Cedar message at Debug for the policy's author:\n%s", debug.String())
	}
}

// A policy whose scope names what no call is (a principal not a User, a
// resource not a Resource, an action not a tool's) is refused when the
// set loads, naming it: it would never apply, and a forbid written so
// loaded and denied nothing, as a misspelt obligation would weaken it.
func TestScopeNoCallMatches(t *testing.T) {
	const permit = `@id("refunds") permit (principal, action == Action::"tool::refund_order", resource);` + "\n"
	for _, tc := range []struct{ name, policy, says string }{
		{"an action without tool::", `forbid (principal, action == Action::"refund_order", resource);`, `Action::"refund_order"`},
		{"an action in a group", `forbid (principal, action in Action::"payments", resource);`, `Action::"payments"`},
		{"a list with one such", `forbid (principal, action in [Action::"tool::refund_order", Action::"cancel_refund"], resource);`, `Action::"cancel_refund"`},
		{"an action of another type", `forbid (principal, action == Other::"tool::refund_order", resource);`, `Other::"tool::refund_order"`},
		{"a resource type", `forbid (principal, action, resource is Order);`, "resource scope is Order"},
		{"a resource of another type", `forbid (principal, action, resource == Order::"t_a/ord_1");`, `Order::"t_a/ord_1"`},
		{"a principal type", `forbid (principal is Agent, action, resource);`, "principal scope is Agent"},
		{"a principal in a group", `forbid (principal in Group::"contractors", action, resource);`, `Group::"contractors"`},
		{"a principal is-in", `forbid (principal is User in Group::"contractors", action, resource);`, `Group::"contractors"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := LoadFS(fstest.MapFS{"p.cedar": &fstest.MapFile{Data: []byte(permit + tc.policy)}}, "v1")
			if !errors.Is(err, ErrInvalidSet) || !strings.Contains(err.Error(), tc.says) {
				t.Errorf("LoadFS = %v; want ErrInvalidSet naming %s", err, tc.says)
			}
		})
	}
	// What calls are loads.
	if _, err := LoadFS(fstest.MapFS{"p.cedar": &fstest.MapFile{Data: []byte(permit + `
forbid (principal == User::"t_a/u_1", action in [Action::"tool::refund_order", Action::"tool::cancel_refund"], resource in Resource::"t_a/ord_1");
forbid (principal is User in User::"t_a/u_2", action, resource is Resource);
`)}}, "v1"); err != nil {
		t.Errorf("LoadFS of scopes calls match = %v", err)
	}
}
