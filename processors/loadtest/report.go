package loadtest

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/toolcall-ledger/ledger/statemachine"
)

// Report is everything one `ledger bench` measured, side by side.
type Report struct {
	Machine Machine   `json:"machine"`
	At      time.Time `json:"at"`
	Kafka   string    `json:"kafka"`
	// KafkaInHarness: the Kafka broker ran in the benchmark's process,
	// so that the harness's CPU holds the broker's work, which depends on
	// the build (its transactions, fetches and records).
	KafkaInHarness bool   `json:"kafka_in_harness,omitempty"`
	Store          string `json:"store"`
	ClickHouse     string `json:"clickhouse,omitempty"`
	// Attached names the ledger the runs drove when it was running
	// already (ledger bench --attach): its topics, its tools' backend
	// and the processes measured. Empty when the benchmark started the
	// ledger processes itself. An attached run's executors are not
	// known (0), nor its ledger's CPU and memory unless its processes
	// were named (Processes 0).
	Attached       string        `json:"attached,omitempty"`
	Mix            string        `json:"mix"`
	Tenants        int           `json:"tenants"`
	Concurrency    int           `json:"concurrency"`
	BackendLatency time.Duration `json:"backend_latency_ns"`
	Runs           []RunReport   `json:"runs"`
	// Baseline is the binary the runs of Build "baseline" ran, when the
	// benchmark compared two builds.
	Baseline string        `json:"baseline,omitempty"`
	Direct   *DirectReport `json:"direct,omitempty"`
	Limits   []Limit       `json:"limits,omitempty"`
	// SLO says up to which offered rate the open-loop runs held an
	// added p99 (CheckSLO); nil when not asked or no run was open loop.
	SLO *SLO `json:"slo,omitempty"`
}

// SLO is how the open-loop runs of this build fared against a bound on
// their added p99, rate by rate from the lowest offered: a rate holds
// when every run at it kept its added p99 under the bound, lost no
// call and kept up with its arrivals.
type SLO struct {
	AddedP99 time.Duration `json:"added_p99_ns"`
	// Held is the highest offered rate at which it held, with every
	// rate below it; 0 when it held at none.
	Held float64 `json:"held_up_to_per_sec"`
	// BrokenAt is the lowest offered rate at which it did not hold,
	// BrokenP99 the worst added p99 there and BrokenBy why it broke
	// (the p99, lost calls, arrivals it could not keep up with); zero
	// when it held at every rate.
	BrokenAt  float64       `json:"broken_at_per_sec,omitempty"`
	BrokenP99 time.Duration `json:"broken_p99_ns,omitempty"`
	BrokenBy  string        `json:"broken_by,omitempty"`
}

// CheckSLO sets rep.SLO from this build's open-loop runs against
// addedP99 (a baseline's runs are another build's, and a closed loop
// has no offered rate); it leaves it nil when addedP99 is not positive
// or no such run exists.
func (rep *Report) CheckSLO(addedP99 time.Duration) {
	rep.SLO = nil
	if addedP99 <= 0 {
		return
	}
	type atRate struct {
		p99       time.Duration
		lost      int64
		saturated bool
	}
	byRate := make(map[float64]*atRate)
	for _, r := range rep.Runs {
		res := r.Result
		if r.Build != "" || res.Mode != "open" || res.Offered <= 0 {
			continue
		}
		a := byRate[res.Offered]
		if a == nil {
			a = &atRate{}
			byRate[res.Offered] = a
		}
		a.p99 = max(a.p99, res.Added.P99)
		a.lost += res.Lost
		a.saturated = a.saturated || res.Saturated
	}
	if len(byRate) == 0 {
		return
	}
	slo := &SLO{AddedP99: addedP99}
	rates := slices.Sorted(maps.Keys(byRate))
	for _, rate := range rates {
		a := byRate[rate]
		var why []string
		if a.p99 >= addedP99 {
			why = append(why, fmt.Sprintf("added p99 %.1f ms", msOf(a.p99)))
		}
		if a.lost > 0 {
			why = append(why, fmt.Sprintf("calls lost: %d", a.lost))
		}
		if a.saturated {
			why = append(why, "could not keep up with the arrivals")
		}
		if len(why) > 0 {
			slo.BrokenAt, slo.BrokenP99, slo.BrokenBy = rate, a.p99, strings.Join(why, ", ")
			break
		}
		slo.Held = rate
	}
	rep.SLO = slo
}

// line is the report's summary of the SLO.
func (slo SLO) line() string {
	bound := fmt.Sprintf("added p99 under %s", slo.AddedP99)
	switch {
	case slo.BrokenAt == 0:
		return fmt.Sprintf("%s: at every rate offered, up to %.0f/s", bound, slo.Held)
	case slo.Held == 0:
		return fmt.Sprintf("%s: at none of the rates offered (at %.0f/s: %s)", bound, slo.BrokenAt, slo.BrokenBy)
	}
	return fmt.Sprintf("%s: up to %.0f/s offered (at %.0f/s: %s)", bound, slo.Held, slo.BrokenAt, slo.BrokenBy)
}

// Machine says where the figures come from.
type Machine struct {
	CPU      string `json:"cpu"`
	Cores    int    `json:"cores"`
	MemoryGB int    `json:"memory_gb"`
	Go       string `json:"go"`
	OS       string `json:"os"`
	// SignsPerSecStart and SignsPerSecEnd are CoreSpeed before the
	// first run and after the last; 0 where not measured.
	SignsPerSecStart float64 `json:"core_signs_per_sec_start,omitempty"`
	SignsPerSecEnd   float64 `json:"core_signs_per_sec_end,omitempty"`
}

// speed is the machine line's reading of CoreSpeed, or "" without one.
func (m Machine) speed() string {
	if m.SignsPerSecStart <= 0 {
		return ""
	}
	s := fmt.Sprintf("; one core signs %.0f Ed25519/s", m.SignsPerSecStart)
	if m.SignsPerSecEnd > 0 {
		s += fmt.Sprintf(" at the start, %.0f at the end", m.SignsPerSecEnd)
	}
	return s
}

// ThisMachine describes the machine the process runs on (CPU model and
// memory from /proc on Linux).
func ThisMachine() Machine {
	m := Machine{Cores: runtime.NumCPU(), Go: runtime.Version(), OS: runtime.GOOS + "/" + runtime.GOARCH, CPU: "unknown"}
	if fh, err := os.Open("/proc/cpuinfo"); err == nil {
		sc := bufio.NewScanner(fh)
		for sc.Scan() {
			if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPU = strings.TrimSpace(v)
				break
			}
		}
		fh.Close()
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		var kb int64
		if _, err := fmt.Sscanf(string(b), "MemTotal: %d kB", &kb); err == nil {
			m.MemoryGB = int((kb + 1<<19) >> 20)
		}
	}
	return m
}

// RunReport is one run of the ledger under load.
type RunReport struct {
	Name string `json:"name"`
	// Build is "baseline" for a run of the Report's Baseline binary, ""
	// for this build's.
	Build     string `json:"build,omitempty"`
	Executors int    `json:"executors"`
	// Processes is the number of ledger processes (the intake's and the
	// executors').
	Processes int     `json:"processes"`
	Result    Result  `json:"result"`
	Witness   Witness `json:"witness"`
	// Warmup is the run's warm-up, checked for duplicates, lost calls
	// and calls that did not succeed; nil when it was not checked.
	Warmup *Warmup `json:"warmup,omitempty"`
	// LedgerCPU is the CPU time of the ledger processes while the run
	// was measured; HarnessCPU that of the benchmark process (load
	// generator, Kafka when in process, the tool backend).
	LedgerCPU  time.Duration `json:"ledger_cpu_ns"`
	HarnessCPU time.Duration `json:"harness_cpu_ns"`
	// KafkaCPU is the CPU time of the Kafka broker's process while the
	// run was measured, when the benchmark ran it apart from itself
	// (--kafka-process); zero otherwise.
	KafkaCPU time.Duration `json:"kafka_cpu_ns,omitempty"`
	// MachineCPU is the busy time of all the machine's CPUs while the run
	// was measured (Linux's /proc/stat: user, nice, system, irq, softirq;
	// zero where it cannot be read): the ledger's and the harness's, and
	// the store's and Kafka's when they run on this machine, and whatever
	// else it did meanwhile.
	MachineCPU time.Duration `json:"machine_cpu_ns"`
	// Stolen is the share of the machine's CPU time, while the run was
	// measured, that its hypervisor gave to other guests while this one
	// had work (/proc/stat's steal; zero where it cannot be read). On a
	// shared host it is why the same build's runs differ: a run that
	// lost a tenth of its CPUs ran on a slower machine.
	Stolen float64 `json:"stolen_share"`
	// StoreCPU is the CPU time of the execution store's server while the
	// run was measured, when it is a PostgreSQL on this machine (its
	// postmaster and every process of it); zero otherwise.
	StoreCPU time.Duration `json:"store_cpu_ns,omitempty"`
	// PeakRSS is the sum over the ledger processes of their peak
	// resident memory.
	PeakRSS int64 `json:"peak_rss_bytes"`
	// StoreRetries counts, by operation (admit, claim, complete, mark
	// logged...), the execution store transactions the ledger processes
	// ran again during the measured run after a serialization failure or
	// a deadlock: each throws a batch's work away. Nil (null in the JSON)
	// when not counted: on the embedded store, which has none.
	StoreRetries map[string]int64 `json:"store_retries"`
	// ProjectionLag, when the run was projected into ClickHouse, is the
	// age of the oldest event not yet projected, sampled while the load
	// ran.
	ProjectionLag *Percentiles `json:"projection_lag,omitempty"`
	// StoreRecords and StoreBytes, when the store can say (PostgreSQL),
	// are the execution records in the run's tables at its end (the
	// warm-up's included) and the disk space of those tables with their
	// indexes, every row version not yet vacuumed included.
	StoreRecords int64 `json:"store_records,omitempty"`
	StoreBytes   int64 `json:"store_bytes,omitempty"`
	// Derived by Derive.
	CPUPerCall         time.Duration `json:"ledger_cpu_per_call_ns"`
	HarnessCPUPerCall  time.Duration `json:"harness_cpu_per_call_ns"`
	MachineCPUPerCall  time.Duration `json:"machine_cpu_per_call_ns"`
	StoreCPUPerCall    time.Duration `json:"store_cpu_per_call_ns,omitempty"`
	KafkaCPUPerCall    time.Duration `json:"kafka_cpu_per_call_ns,omitempty"`
	PeakRSSPerCall     float64       `json:"peak_rss_bytes_per_call"`
	PerSecPerExecutor  float64       `json:"calls_per_sec_per_executor"`
	PerSecPerLedgerCPU float64       `json:"calls_per_ledger_cpu_sec"`
	StoreBytesPerCall  float64       `json:"store_bytes_per_call,omitempty"`
}

// Derive fills the per-call figures from the totals.
func (r *RunReport) Derive() {
	if n := r.Result.Finished; n > 0 {
		r.CPUPerCall = r.LedgerCPU / time.Duration(n)
		r.HarnessCPUPerCall = r.HarnessCPU / time.Duration(n)
		r.MachineCPUPerCall = r.MachineCPU / time.Duration(n)
		r.StoreCPUPerCall = r.StoreCPU / time.Duration(n)
		r.KafkaCPUPerCall = r.KafkaCPU / time.Duration(n)
		r.PeakRSSPerCall = float64(r.PeakRSS) / float64(n)
	}
	if r.Executors > 0 {
		r.PerSecPerExecutor = r.Result.PerSec / float64(r.Executors)
	}
	if r.LedgerCPU > 0 {
		r.PerSecPerLedgerCPU = float64(r.Result.Finished) / r.LedgerCPU.Seconds()
	}
	if r.StoreRecords > 0 {
		r.StoreBytesPerCall = float64(r.StoreBytes) / float64(r.StoreRecords)
	}
}

// Failures lists what makes the run a failure whatever its speed: a
// duplicate or missing effect, an attempt sent twice, a lost call, a call
// that ended other than succeeded (its calls/s and latencies would count
// calls that never ran), in the measured run or its warm-up.
func (rep Report) Failures() []string {
	var bad []string
	for _, r := range rep.Runs {
		bad = append(bad, r.Result.failures(r.Name, r.Witness)...)
		if w := r.Warmup; w != nil {
			bad = append(bad, w.Result.failures(r.Name+" (warm-up)", w.Witness)...)
		}
	}
	return bad
}

// failures are Failures' of one run, named name, and its witness w.
func (res Result) failures(name string, w Witness) []string {
	bad := w.Failures(name)
	if res.Lost > 0 {
		bad = append(bad, fmt.Sprintf("%s: %d calls lost", name, res.Lost))
	}
	if n := res.Finished - res.ByState[string(statemachine.StateSucceeded)]; n > 0 {
		var states []string
		for _, st := range slices.Sorted(maps.Keys(res.ByState)) {
			if st != string(statemachine.StateSucceeded) {
				states = append(states, fmt.Sprintf("%s %d", st, res.ByState[st]))
			}
		}
		bad = append(bad, fmt.Sprintf("%s: %d calls did not succeed (%s), and count in its calls/s and latencies", name, n, strings.Join(states, ", ")))
	}
	return bad
}

// Warmup is what a run's warm-up did, checked as the run is: its calls
// are where fresh processes join their groups.
type Warmup struct {
	Result  Result  `json:"result"`
	Witness Witness `json:"witness"`
}

// WriteJSON writes the report as indented JSON.
func (rep Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(rep)
}

// WriteTable writes the report as aligned text tables.
func (rep Report) WriteTable(w io.Writer) error {
	m := rep.Machine
	fmt.Fprintf(w, "machine: %s, %d cores, %d GB, %s %s%s\n", m.CPU, m.Cores, m.MemoryGB, m.Go, m.OS, m.speed())
	fmt.Fprintf(w, "kafka: %s; store: %s; mix: %s; %d tenants; concurrency %d; backend latency %s\n\n",
		rep.Kafka, rep.Store, rep.Mix, rep.Tenants, rep.Concurrency, rep.BackendLatency)
	if rep.Attached != "" {
		fmt.Fprintf(w, "ledger: already running, not started by the benchmark (%s)\n\n", rep.Attached)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "run\tmode\texec\tcalls\tcalls/s\tp50 ms\tp95 ms\tp99 ms\tp99.9 ms\tadded p50\tadded p99\tCPU µs/call\tharness µs/call\tstore µs/call\tmachine µs/call\tpeak RSS MB\tdup\tlost\tstolen %\tkafka µs/call\t")
	for _, r := range rep.Runs {
		res := r.Result
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%.0f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%s\t%.0f\t%s\t%s\t%s\t%d\t%d\t%s\t%s\t\n",
			r.Name, r.mode(), r.executors(), res.Finished, res.PerSec,
			msOf(res.E2E.P50), msOf(res.E2E.P95), msOf(res.E2E.P99), msOf(res.E2E.P999),
			msOf(res.Added.P50), msOf(res.Added.P99),
			r.ledgerOrDash(fmt.Sprintf("%.0f", usOf(r.CPUPerCall))), usOf(r.HarnessCPUPerCall),
			usOrDash(r.StoreCPUPerCall), usOrDash(r.MachineCPUPerCall),
			r.ledgerOrDash(fmt.Sprintf("%.0f", float64(r.PeakRSS)/(1<<20))), r.Witness.Duplicates, res.Lost, r.stolen(), usOrDash(r.KafkaCPUPerCall))
	}
	if d := rep.Direct; d != nil {
		// The direct calls have no ledger to lose them: the last
		// column counts the ones that failed.
		fmt.Fprintf(tw, "direct to backend (lost: errors)\tclosed\t-\t%d\t%.0f\t%.1f\t%.1f\t%.1f\t%.1f\t-\t-\t-\t-\t-\t-\t-\t-\t%d\t-\t-\t\n",
			d.Calls, d.PerSec, msOf(d.Latency.P50), msOf(d.Latency.P95), msOf(d.Latency.P99), msOf(d.Latency.P999), d.Errors)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if d := rep.Direct; d != nil && d.Note != "" {
		fmt.Fprintf(w, "direct: %s\n", d.Note)
	}
	for _, r := range rep.runsWhere(func(r RunReport) bool { return r.Result.RetriedLater > 0 }) {
		fmt.Fprintf(w, "%s: %d envelopes refused for now and submitted again after the wait they named (%s)\n",
			r.Name, r.Result.RetriedLater, countsOf(r.Result.RetryReasons))
	}
	if err := rep.writeSideBySide(w); err != nil {
		return err
	}
	if staged := rep.runsWhere(func(r RunReport) bool { return r.Result.Stages.Calls > 0 }); len(staged) > 0 {
		fmt.Fprintln(w, "\nwhere the time goes, ms p50 / p99 (publish -> authorized read -> call started -> call ended -> terminal read):")
		tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "run\tmode\tcalls\tintake\tclaim\tcall\trecord\tstore retries\t")
		for _, r := range staged {
			st := r.Result.Stages
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\t%s\t%s\t\n", r.Name, r.mode(), st.Calls,
				p50p99(st.Intake), p50p99(st.Claim), p50p99(st.Call), p50p99(st.Record), retries(r.StoreRetries))
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	if measured := rep.runsWhere(func(r RunReport) bool { return r.StoreRecords > 0 }); len(measured) > 0 {
		fmt.Fprintln(w, "\nthe store's tables at the end of each run (indexes and row versions not yet vacuumed included):")
		tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "run\trecords\tMB\tbytes/call\t")
		for _, r := range measured {
			fmt.Fprintf(tw, "%s\t%d\t%.1f\t%.0f\t\n", r.Name, r.StoreRecords, float64(r.StoreBytes)/(1<<20), r.StoreBytesPerCall)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	if lagged := rep.runsWhere(func(r RunReport) bool { return r.ProjectionLag != nil }); len(lagged) > 0 {
		fmt.Fprintf(w, "\nprojection lag into ClickHouse (%s), sampled while the load ran:\n", rep.ClickHouse)
		tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "run\tp50 ms\tp99 ms\tmax ms\t")
		for _, r := range lagged {
			fmt.Fprintf(tw, "%s\t%.0f\t%.0f\t%.0f\t\n", r.Name, msOf(r.ProjectionLag.P50), msOf(r.ProjectionLag.P99), msOf(r.ProjectionLag.Max))
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	if len(rep.Limits) > 0 {
		fmt.Fprintln(w)
		tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "raw limit\tops\tbatch\tper second\twhat")
		for _, l := range rep.Limits {
			fmt.Fprintf(tw, "%s\t%d\t%d\t%.0f\t%s\n", l.Name, l.Ops, l.Batch, l.PerSec, l.Note)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	// The ratios are of what the ledger can carry: an open-loop run
	// (--rate) finishes what it is offered, and its rate says nothing of
	// that.
	if mains := rep.runsWhere(func(r RunReport) bool { return r.Build == "" && r.Result.Mode != "open" }); len(mains) > 0 {
		main := mains[0].Result.PerSec
		fmt.Fprintln(w)
		if d := rep.Direct; d != nil && d.PerSec > 0 {
			fmt.Fprintf(w, "ledger / direct: %.0f%%\n", 100*main/d.PerSec)
		}
		if slow, name := rep.slowestLimit(); slow > 0 {
			fmt.Fprintf(w, "ledger / slowest raw limit (%s): %.0f%%\n", name, 100*main/slow)
		}
	}
	if rep.SLO != nil {
		if _, err := fmt.Fprintln(w, rep.SLO.line()); err != nil {
			return err
		}
	}
	return nil
}

// slowestLimit is the raw limit that bounds the ledger: Kafka records are
// divided by the events a call appends (about four), store claims are per
// call.
func (rep Report) slowestLimit() (perCall float64, name string) {
	for _, l := range rep.Limits {
		v := l.PerSec
		switch l.Name {
		case "kafka_txn_consume_produce":
			v /= EventsPerCall
		case "store_complete":
			continue
		}
		if perCall == 0 || v < perCall {
			perCall, name = v, l.Name
		}
	}
	return perCall, name
}

// EventsPerCall is how many events a call that runs appends (requested,
// authorized, executing, succeeded): the Kafka raw limit in records/s is
// divided by it to compare it with calls/s.
const EventsPerCall = 4

func msOf(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func usOf(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }

// usOrDash is a per-call CPU figure in µs, "-" when not measured.
func usOrDash(d time.Duration) string {
	if d <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.0f", usOf(d))
}

// sideBySide are the figures the comparison of two builds shows, each
// read from a run, and whether more is better.
var sideBySide = []struct {
	name   string
	of     func(RunReport) float64
	higher bool
	// control marks a figure neither build decides (the hypervisor's):
	// its change is in points and no pair is better for it.
	control bool
}{
	{"calls/s", func(r RunReport) float64 { return r.Result.PerSec }, true, false},
	{"e2e p50 ms", func(r RunReport) float64 { return msOf(r.Result.E2E.P50) }, false, false},
	{"e2e p99 ms", func(r RunReport) float64 { return msOf(r.Result.E2E.P99) }, false, false},
	{"ledger CPU µs/call", func(r RunReport) float64 { return usOf(r.CPUPerCall) }, false, false},
	{"store µs/call", func(r RunReport) float64 { return usOf(r.StoreCPUPerCall) }, false, false},
	{"kafka µs/call", func(r RunReport) float64 { return usOf(r.KafkaCPUPerCall) }, false, false},
	{"machine µs/call", func(r RunReport) float64 { return usOf(r.MachineCPUPerCall) }, false, false},
	{harnessFigure, func(r RunReport) float64 { return usOf(r.HarnessCPUPerCall) }, false, false},
	{stolenFigure, func(r RunReport) float64 { return 100 * r.Stolen }, false, true},
}

// stolenFigure is the other control: the hypervisor's doing, not either
// build's.
const stolenFigure = "stolen %"

// harnessFigure is the control among the side-by-side figures: the
// benchmark process runs the same code (load, tools, and Kafka unless it
// runs apart) against both builds, so its change is the machine's drift
// between their runs, and a build's change of that size or less is not
// the build's.
const harnessFigure = "harness µs/call"

// writeSideBySide writes, when the report compares two builds, the median
// of each figure over each build's runs, the change from the baseline,
// and in how many pairs (baseline #i and ledger #i, run one after the
// other) this build did better. Medians, because a run the machine slowed
// for reasons of its own should not decide the comparison; the count,
// because on a noisy machine a change that wins every pair means more
// than one whose medians moved. The runs themselves are in the main
// table.
func (rep Report) writeSideBySide(w io.Writer) error {
	// The pairs' runs only: this build's sweep, scaling and sizes runs
	// have no counterpart.
	base := rep.runsWhere(func(r RunReport) bool { return r.Build == "baseline" })
	this := rep.runsWhere(func(r RunReport) bool {
		return r.Build == "" && strings.HasPrefix(r.Name, "ledger #")
	})
	if len(base) == 0 || len(this) == 0 {
		return nil
	}
	fmt.Fprintf(w, "\nside by side, medians of %d runs each, builds alternating (baseline: %s):\n", len(this), rep.Baseline)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "figure\tbaseline\tthis build\tchange\tbetter in\t")
	pairs := pairUp(base, this)
	control, stolen := "", ""
	for _, f := range sideBySide {
		b, t := median(base, f.of), median(this, f.of)
		if b == 0 && t == 0 {
			// Not measured (the store's CPU, say).
			continue
		}
		change := "-"
		switch {
		case f.control:
			change = fmt.Sprintf("%+.1f pp", t-b)
		case b != 0:
			change = fmt.Sprintf("%+.1f%%", 100*(t-b)/b)
		}
		switch f.name {
		case harnessFigure:
			control = change
		case stolenFigure:
			stolen = fmt.Sprintf("%.1f%% and %.1f%%", b, t)
		}
		betterIn := "-"
		if !f.control {
			better := 0
			for _, p := range pairs {
				if pb, pt := f.of(p[0]), f.of(p[1]); f.higher && pt > pb || !f.higher && pt < pb {
					better++
				}
			}
			betterIn = fmt.Sprintf("%d of %d pairs", better, len(pairs))
		}
		fmt.Fprintf(tw, "%s\t%.1f\t%.1f\t%s\t%s\t\n", f.name, b, t, change, betterIn)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	switch {
	case control != "" && rep.KafkaInHarness:
		if _, err := fmt.Fprintf(w, "(the harness runs the same code against both builds, but here also the Kafka broker, whose work each build makes: its change, %s, is the machine's drift only roughly; --kafka-process runs the broker apart and makes the harness a control)\n", control); err != nil {
			return err
		}
	case control != "":
		if _, err := fmt.Fprintf(w, "(the harness runs the same code against both builds: its change, %s, is the machine's drift between their runs; a change no larger is noise)\n", control); err != nil {
			return err
		}
	}
	if stolen != "" {
		_, err := fmt.Fprintf(w, "(the hypervisor took %s of the machine's CPU time from the baseline's and this build's runs: where those differ, so did the machine)\n", stolen)
		return err
	}
	return nil
}

// executors is the run's executor count, "-" when not known (an
// attached ledger's).
func (r RunReport) executors() string {
	if r.Executors <= 0 {
		return "-"
	}
	return strconv.Itoa(r.Executors)
}

// ledgerOrDash is s, a figure of the ledger's processes, or "-" when no
// process was measured (an attached ledger whose processes were not
// named).
func (r RunReport) ledgerOrDash(s string) string {
	if r.Processes == 0 {
		return "-"
	}
	return s
}

// stolen is the run's stolen share for the table, in percent, "-" when
// the machine's CPU time was not read.
func (r RunReport) stolen() string {
	if r.MachineCPU <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f", 100*r.Stolen)
}

// pairUp matches baseline #i with ledger #i: [baseline, this build].
func pairUp(base, this []RunReport) [][2]RunReport {
	byNumber := make(map[string]RunReport, len(base))
	for _, r := range base {
		byNumber[strings.TrimPrefix(r.Name, "baseline ")] = r
	}
	var pairs [][2]RunReport
	for _, r := range this {
		if b, ok := byNumber[strings.TrimPrefix(r.Name, "ledger ")]; ok {
			pairs = append(pairs, [2]RunReport{b, r})
		}
	}
	return pairs
}

// median is the median of of over runs.
func median(runs []RunReport, of func(RunReport) float64) float64 {
	vs := make([]float64, len(runs))
	for i, r := range runs {
		vs[i] = of(r)
	}
	slices.Sort(vs)
	n := len(vs)
	if n%2 == 1 {
		return vs[n/2]
	}
	return (vs[n/2-1] + vs[n/2]) / 2
}

// mode names the run's loop: closed, or open at its offered rate.
func (r RunReport) mode() string {
	res := r.Result
	if res.Mode != "open" {
		return res.Mode
	}
	mode := fmt.Sprintf("open %.0f/s", res.Offered)
	if res.Saturated {
		mode += " (saturated)"
	}
	return mode
}

// retries is a run's store retries for the table: the total and the
// operations that had any, "-" when not counted.
func retries(byOp map[string]int64) string {
	if byOp == nil {
		return "-"
	}
	var total int64
	for _, n := range byOp {
		total += n
	}
	if total == 0 {
		return "0"
	}
	return fmt.Sprintf("%d (%s)", total, countsOf(byOp))
}

// countsOf lists counts by name, sorted by name: "a 1, b 2".
func countsOf(m map[string]int64) string {
	parts := make([]string, 0, len(m))
	for k, n := range m {
		parts = append(parts, fmt.Sprintf("%s %d", k, n))
	}
	slices.Sort(parts)
	return strings.Join(parts, ", ")
}

func p50p99(p Percentiles) string {
	return fmt.Sprintf("%.1f / %.1f", msOf(p.P50), msOf(p.P99))
}

// runsWhere are the runs keep keeps.
func (rep Report) runsWhere(keep func(RunReport) bool) []RunReport {
	var out []RunReport
	for _, r := range rep.Runs {
		if keep(r) {
			out = append(out, r)
		}
	}
	return out
}
