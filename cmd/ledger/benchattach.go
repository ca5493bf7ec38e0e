package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"net/http"
	neturl "net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/spf13/pflag"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/processors/httptool"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/processors/loadtest"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// attachFlags let `ledger bench` drive a ledger that is already running
// (`ledger dev`, a staging deployment) instead of starting its own.
type attachFlags struct {
	attach     bool
	toolsURL   string
	dataDir    string
	issuerKey  string
	issuerName string
	ledgerPIDs []int
	ledgerOps  []string
}

// attachOnly are the flags that mean something only with --attach.
var attachOnly = []string{"tools-url", "data-dir", "issuer-key", "issuer", "ledger-pid", "ledger-ops"}

func (f *attachFlags) register(fs *pflag.FlagSet) {
	fs.BoolVar(&f.attach, "attach", false, "drive a ledger that is already running (ledger dev, or a deployment) instead of starting one: the calls go to its request topic (--topic-requests) on --kafka-brokers, their events are read from --topic-events, and the bench creates, restarts and drops nothing of the ledger's; the runs are the main run, --sweep and --sizes")
	fs.StringVar(&f.toolsURL, "tools-url", "http://127.0.0.1:8081", "with --attach: the demo tool backend the running ledger's tools call (ledger dev serves it on its --backend-addr, ledger demo-backend on its --addr): duplicate and missing effects are counted from its GET /effects, and the direct floor calls it, or a backend of the bench's own if it refuses calls without the ledger's credential")
	fs.StringVar(&f.dataDir, "data-dir", devDataDir, "with --attach: the data directory of the ledger dev being driven, whose dev issuer signs the agents' assertions (unless --issuer-key)")
	// dev takes its directory from its command line alone: so does
	// whatever finds dev's issuer in it.
	ignoreEnv(fs, "data-dir")
	fs.StringVar(&f.issuerKey, "issuer-key", "", "with --attach: the private key file (a JWK, as ledger dev keeps its own) of the agents' identity provider, instead of the dev issuer; if missing, the bench creates it, writes its public keys beside it (<file>.jwks.json) and stops, for the ledger's intake to be started trusting them (--issuer, --jwks-file)")
	fs.StringVar(&f.issuerName, "issuer", "", "with --issuer-key: the issuer name under which the running ledger trusts that key")
	fs.StringSliceVar(&f.ledgerOps, "ledger-ops", nil, "with --attach: where the running ledger's processes serve GET /loops, comma separated (a role's --metrics-addr as http://host:port, or ledger dev's API): the timeline then shows how busy its intake's and executors' loops were each second, and with --profile their profiles are taken there")
	fs.IntSliceVar(&f.ledgerPIDs, "ledger-pid", nil, "with --attach: the running ledger's process ids on this machine, comma separated: their CPU per call and peak RSS (each process's since it started, not the run's) are reported, and one that exits ends the run (without, those columns read -)")
}

// checkAttachFlags refuses what --attach cannot do, and the attach-only
// flags without it, before anything starts. fs is the command's flags,
// their values from the command line or, by bindEnv, LEDGER_<FLAG>. A
// deployment's shell may hold such variables for other commands (the
// roles share LEDGER_DATA_DIR, LEDGER_ISSUER, LEDGER_BATCH_LINGER...):
// what they set is refused only where it would change what the bench
// does, and named with its variable.
func (f *benchFlags) checkAttachFlags(fs *pflag.FlagSet) error {
	// what names a flag in a message: its variable too, when the value
	// came from there.
	what := func(name string) string {
		if fs.Changed(name) {
			return "--" + name
		}
		return fmt.Sprintf("--%s (set by %s)", name, envName(name))
	}
	if !f.attach {
		// Without --attach their values are never read: only a
		// command line that names them is a mistake.
		for _, name := range attachOnly {
			if fs.Changed(name) {
				return fmt.Errorf("bench: --%s is for --attach", name)
			}
		}
		return nil
	}
	// What starts, configures or restarts ledger processes, which a
	// ledger the bench did not start does not let it do: refused when
	// its value is not the default, wherever it came from. The
	// processes' batching, policy budget and log level are passed on
	// only when given on the command line (nodeFlags), so only that is
	// refused.
	for _, name := range []string{"baseline", "scaling", "executors", "intake-process", "kafka-process", "backend-latency", "backend-verify", "clickhouse-dsn"} {
		if fl := fs.Lookup(name); fl.Value.String() != fl.DefValue {
			if name == "clickhouse-dsn" {
				// The bench's projector reads a run's events topic
				// from its start: an attached ledger's holds its whole
				// history, whose replay the lag would measure.
				return fmt.Errorf("bench: %s projects the topics of the ledgers the bench starts; an attached ledger's projection is its own: unset it for --attach", what(name))
			}
			return fmt.Errorf("bench: %s configures the ledger processes the bench starts; with --attach it drives one already running", what(name))
		}
	}
	for _, name := range append([]string{"node-log-level"}, nodePassedOn...) {
		if fs.Changed(name) {
			return fmt.Errorf("bench: --%s configures the ledger processes the bench starts; with --attach it drives one already running", name)
		}
	}
	switch {
	case f.toolsURL == "":
		return errors.New("bench: --attach needs --tools-url, the backend whose effects show duplicates")
	case f.issuerKey != "" && f.issuerName == "":
		return fmt.Errorf("bench: %s needs --issuer, the name the running ledger trusts it under", what("issuer-key"))
	case f.issuerKey == "" && fs.Changed("issuer"):
		// From the environment it is likely the intake's own
		// LEDGER_ISSUER: without --issuer-key it is not read.
		return errors.New("bench: --issuer names the provider of --issuer-key")
	}
	for _, pid := range f.ledgerPIDs {
		if pid <= 0 {
			return fmt.Errorf("bench: --ledger-pid %d is not a process id", pid)
		}
	}
	for _, base := range f.ledgerOps {
		if u, err := neturl.Parse(base); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return fmt.Errorf("bench: --ledger-ops %q is not an http(s)://host:port URL", base)
		}
	}
	if f.profile != "" {
		// The running processes profile themselves (--pprof), for a
		// length fixed when the profile starts.
		switch {
		case len(f.ledgerOps) == 0:
			return fmt.Errorf("bench: %s with --attach profiles the processes --ledger-ops names (started with --pprof): give their addresses", what("profile"))
		case f.calls != 0 || f.duration <= 0:
			return fmt.Errorf("bench: %s with --attach needs --calls 0 and --duration: a running process's profile is asked for a length when it starts", what("profile"))
		}
	}
	return nil
}

// attachWarmupDrain is how long an attached run's warm-up waits for a
// call to finish, twice (before it stops submitting, then for the calls
// in flight): a ledger that is not running on the topics finishes none.
const attachWarmupDrain = 15 * time.Second

// attachedPoll is how often a run asks /proc whether the attached
// ledger's processes still run.
const attachedPoll = 250 * time.Millisecond

// attach readies e to drive the running ledger: the issuer its intake
// trusts, its backend, its processes; and says so in report.
func (e *benchEnv) attach(ctx context.Context, report *loadtest.Report) error {
	var err error
	if e.f.issuerKey == "" {
		e.issuer, err = devIssuer(e.f.dataDir)
	} else {
		e.issuer, err = e.attachIssuer()
	}
	if err != nil {
		return fmt.Errorf("bench: --attach: the agents' issuer: %w", err)
	}
	e.toolsURL = strings.TrimSuffix(e.f.toolsURL, "/")
	for _, pid := range e.f.ledgerPIDs {
		st, err := readProcStat("/proc", pid)
		if err != nil {
			return fmt.Errorf("bench: --ledger-pid %d: no such process on this machine (%v)", pid, err)
		}
		e.attached = append(e.attached, &benchNode{what: "attached ledger process", pid: pid, start: st.start})
	}
	// Before any load: the backend must be one whose effects can be
	// read, a demo backend, which the direct floor may also call.
	if _, err := e.effects(ctx, "p"+e.id); err != nil {
		return fmt.Errorf("bench: --attach: --tools-url %s: %w", e.toolsURL, err)
	}
	// Asked once now, so that a wrong address is said before the load
	// rather than read as loops that never work.
	for _, base := range e.f.ledgerOps {
		url := strings.TrimSuffix(base, "/") + loopsPath
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		times, err := readLoops(rctx, e.pages, url)
		cancel()
		if err == nil && len(times) == 0 {
			err = errors.New("no loops served")
		}
		if err != nil {
			return fmt.Errorf("bench: --ledger-ops %s: %w", base, err)
		}
		e.attachedLoops = append(e.attachedLoops, url)
		if e.f.profile != "" {
			if err := pprofServed(ctx, e.pages, base); err != nil {
				return fmt.Errorf("bench: --profile: --ledger-ops %s serves no profiles: %w (start the process with --pprof)", base, err)
			}
		}
	}
	topics := e.g.kafka.topics()
	report.Attached = fmt.Sprintf("requests %s, events %s, tools %s", topics.Requests, topics.Events, e.toolsURL)
	if len(e.attached) > 0 {
		report.Attached += fmt.Sprintf(", processes %v", e.f.ledgerPIDs)
	}
	if len(e.f.ledgerOps) > 0 {
		report.Attached += ", loops from " + strings.Join(e.f.ledgerOps, " ")
	}
	report.Store = "the running ledger's"
	switch {
	case !e.f.limits:
	case e.f.crdbDSN != "":
		report.Store += "; raw limit on " + redactDSN(e.f.crdbDSN)
	default:
		report.Store += "; raw limit on an embedded store in the work directory"
	}
	return nil
}

// attachIssuer loads the agents' issuer of --issuer-key. A missing key
// is created, with its public key set beside it (issuerKey), and the
// bench stops there: a running intake reads its --jwks-file when it
// starts (and again as the file changes), so it must be started with it
// before any call can pass.
func (e *benchEnv) attachIssuer() (*identity.Issuer, error) {
	iss, jwks, created, err := issuerKey(e.f.issuerKey, e.f.issuerName)
	if err != nil {
		return nil, err
	}
	if created {
		return nil, fmt.Errorf("%w: created %s, its public keys in %s: start the ledger's intake with --issuer %s --jwks-file %s (or add those keys to the key set it reads), then run the bench again",
			errIssuerCreated, e.f.issuerKey, jwks, e.f.issuerName, jwks)
	}
	return iss, nil
}

// errIssuerCreated: --issuer-key named a key that did not exist; the
// bench created it and stopped.
var errIssuerCreated = errors.New("a new key")

// effects are what the tool backend applied of run runID's calls (the
// witness picks them out by their keys): the bench's own backend's,
// which holds only the run's, or with --attach the running ledger's,
// asked for the keys of the run only, for it keeps every effect of its
// life.
func (e *benchEnv) effects(ctx context.Context, runID string) ([]demobackend.Effect, error) {
	if e.backend != nil {
		return e.backend.Effects(), nil
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	url := e.toolsURL + "/effects?key_contains=" + neturl.QueryEscape(":"+runID+"-")
	var effects []demobackend.Effect
	// No bound on the answer: the run's effects, a few hundred bytes a
	// call. A tool, not a ledger server: asked as the executors ask
	// tools, trusting the system's roots, without the client flags.
	if err := getJSON(ctx, http.DefaultClient, url, math.MaxInt64, &effects); err != nil {
		return nil, fmt.Errorf("the backend's effects (is --tools-url the demo backend?): %w", err)
	}
	return effects, nil
}

// checkAttachedWarmup says why an attached ledger's warm-up went wrong:
// no ledger on the topics, or one whose policy or tools do not let the
// calls succeed. Its figures would measure that, not the ledger.
func (e *benchEnv) checkAttachedWarmup(topics ledger.Topics, res loadtest.Result) error {
	if res.Finished == 0 {
		return fmt.Errorf("none of the %d calls submitted reached a terminal event in %v: is a ledger running on %s with request topic %s and events topic %s?",
			res.Submitted, res.Elapsed.Round(time.Second), strings.Join(e.brokers, ","), topics.Requests, topics.Events)
	}
	var other []string
	for _, st := range slices.Sorted(maps.Keys(res.ByState)) {
		if n := res.ByState[st]; n > 0 && st != string(statemachine.StateSucceeded) {
			other = append(other, fmt.Sprintf("%d %s", n, st))
		}
	}
	if len(other) > 0 || res.Lost > 0 {
		if res.Lost > 0 {
			other = append(other, fmt.Sprintf("%d lost", res.Lost))
		}
		return fmt.Errorf("of %d calls, %s: the running ledger must let the mix (%s) succeed for the bench's %d tenants (its trust in the agents' issuer, its policy, its tools' backend at %s)",
			res.Finished+res.Lost, strings.Join(other, ", "), e.f.mix, e.f.tenants, e.toolsURL)
	}
	return nil
}

// floorCall makes one direct call to the tool backend at url.
type floorCall func(ctx context.Context, url string, tool loadtest.Tool, tenant, key string, args []byte) error

// floorBackend is the backend the direct floor calls with --attach: the
// running ledger's, unless it refuses calls that carry no credential of
// the ledger's (`ledger dev`'s checks them), which the bench cannot
// mint; then a demo backend of the bench's own, the same code without
// that check, and a note saying so. stop stops what it started.
func (e *benchEnv) floorBackend(ctx context.Context, call floorCall) (url, note string, stop func(), err error) {
	args, err := json.Marshal(e.tools[0].Args(0))
	if err != nil {
		return "", "", nil, err
	}
	err = call(ctx, e.toolsURL, e.tools[0], "t_probe", "p"+e.id, args)
	var te *httptool.Error
	switch {
	case err == nil:
		return e.toolsURL, "", func() {}, nil
	case !errors.As(err, &te) || (te.Status != http.StatusUnauthorized && te.Status != http.StatusForbidden):
		return "", "", nil, fmt.Errorf("bench: direct calls to %s: %w", e.toolsURL, err)
	}
	own := demobackend.New(demobackend.Config{Logger: e.logger.With("component", "demobackend")})
	srv, url, err := serveBackend(own)
	if err != nil {
		own.Close()
		return "", "", nil, err
	}
	note = fmt.Sprintf("the running ledger's backend refuses calls without its credential (status %d): these went to a demo backend of the bench's own, which checks none", te.Status)
	fmt.Fprintf(e.progress, "bench: %s\n", note)
	return url, note, func() { srv.Close(); own.Close() }, nil
}

// pprofServed says whether base serves the runtime's profiles (--pprof).
func pprofServed(ctx context.Context, hc *http.Client, base string) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	return httpGet(ctx, hc, strings.TrimSuffix(base, "/")+pprofPrefix, func(io.Reader) error { return nil })
}

// profileAttached takes, over the next d, the CPU profile and the
// allocations of each process --ledger-ops names, from its
// /debug/pprof/ (served with --pprof), into
// <prefix>-ledger<M>.cpu.pprof and .allocs.pprof (M from 1, in
// --ledger-ops order). The returned wait ends once each is written or
// has failed, and says which: a profile missing is a figure missing,
// not a run lost.
func (e *benchEnv) profileAttached(ctx context.Context, prefix string, d time.Duration) (wait func() []string) {
	secs := strconv.Itoa(max(1, int(math.Ceil(d.Seconds()))))
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		lines []string
	)
	for i, base := range e.f.ledgerOps {
		for _, kind := range []string{"cpu", "allocs"} {
			path := pprofPrefix + "profile?seconds=" + secs
			if kind == "allocs" {
				// A delta: the allocations of these seconds only.
				path = pprofPrefix + "allocs?seconds=" + secs
			}
			file := fmt.Sprintf("%s-ledger%d.%s.pprof", prefix, i+1, kind)
			wg.Go(func() {
				line := fmt.Sprintf("the %s profile of %s: %s", kind, base, file)
				if err := saveURL(ctx, e.pages, strings.TrimSuffix(base, "/")+path, file, d+time.Minute); err != nil {
					line = fmt.Sprintf("the %s profile of %s not taken: %v", kind, base, err)
				}
				mu.Lock()
				lines = append(lines, line)
				mu.Unlock()
			})
		}
	}
	return func() []string {
		wg.Wait()
		mu.Lock()
		defer mu.Unlock()
		slices.Sort(lines)
		return slices.Clone(lines)
	}
}

// saveURL writes the body of a 200 answer to GET url into file, within
// limit.
func saveURL(ctx context.Context, hc *http.Client, url, file string, limit time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	return httpGet(ctx, hc, url, func(body io.Reader) error {
		f, err := os.Create(file)
		if err != nil {
			return err
		}
		_, err = io.Copy(f, body)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			// Not half a profile, which would read as a whole one.
			_ = os.Remove(file)
		}
		return err
	})
}
