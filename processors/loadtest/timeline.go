package loadtest

import (
	"fmt"
	"io"
	"text/tabwriter"
	"time"
)

// Interval is one slice of a run's timeline: the calls submitted and
// finished in it, the latencies of those that finished, and the CPU the
// parts of the system spent meanwhile. A whole run's p99 says how long
// the tail is; the timeline says when it happened and what else did:
// whether every stage slowed at once (the machine) or one did (a part),
// and whether the harness's garbage collector or the store was busy
// just then.
type Interval struct {
	// End is the interval's end, counted from the run's start.
	End time.Duration `json:"end_ns"`
	// Submitted is the calls submitted in the interval.
	Submitted int64 `json:"submitted"`
	// Finished is the calls whose terminal event was read in it.
	Finished int64 `json:"finished"`
	// InFlight is the calls submitted and not finished at End.
	InFlight int `json:"in_flight"`
	// E2E is the end-to-end latency of the calls finished in the
	// interval (by when their terminal event was read, not when they
	// arrived).
	E2E Percentiles `json:"e2e"`
	// IntakeP99, ClaimP99, CallP99 and RecordP99 are the p99 of each
	// stage (see Stages) of the calls finished in the interval.
	IntakeP99 time.Duration `json:"intake_p99_ns"`
	ClaimP99  time.Duration `json:"claim_p99_ns"`
	CallP99   time.Duration `json:"call_p99_ns"`
	RecordP99 time.Duration `json:"record_p99_ns"`
	// Usage is what the parts of the system spent in the interval (CPU,
	// and the loops' busy time), when Config.Usage is set.
	Usage *Usage `json:"usage,omitempty"`
}

// Usage is CPU time spent by the parts of the system under test, and the
// time the ledger's loops were busy, as the caller of Run measures them.
// Config.Usage returns running totals; each Interval holds what they grew
// by in it.
type Usage struct {
	Ledger  time.Duration `json:"ledger_ns"`
	Store   time.Duration `json:"store_ns,omitempty"`
	Harness time.Duration `json:"harness_ns"`
	// Kafka is the broker's process's, when the benchmark runs it apart
	// from the harness; zero otherwise (an in-process broker's CPU is in
	// Harness, another machine's or another process's in neither).
	Kafka time.Duration `json:"kafka_ns,omitempty"`
	// HarnessGC is the Go runtime's estimate of the CPU its garbage
	// collector spent in the harness (runtime/metrics'
	// /cpu/classes/gc/total). The runtime counts a cycle when it ends,
	// and its pauses on every processor, so this says when the
	// collector was busy and roughly how much, not an exact share of
	// Harness: it can exceed it in a second where a long cycle ended.
	HarnessGC time.Duration `json:"harness_gc_ns"`
	// Machine is the busy time of all the machine's CPUs.
	Machine time.Duration `json:"machine_ns,omitempty"`
	// Stolen is the time the machine's CPUs had work and the hypervisor
	// ran another guest instead (/proc/stat's steal).
	Stolen time.Duration `json:"stolen_ns,omitempty"`
	// IntakeLoop and ExecutorLoops are wall time, not CPU: what the
	// intake's loop and the executors' loops (summed) spent in their
	// steps and transactions (ledger.Loop.Time). The rest of an
	// interval they mostly waited for records. A loop that steps as
	// soon as a poll returns is busy the whole interval whenever calls
	// arrive faster than its cycle, so this says how long its cycles
	// are, not that it is saturated.
	IntakeLoop    time.Duration `json:"intake_loop_ns,omitempty"`
	ExecutorLoops time.Duration `json:"executor_loops_ns,omitempty"`
	// IntakeSteps and ExecutorSteps count those loops' steps given
	// records. Busy time over steps is a loop's mean cycle as the
	// timeline prints it: its busy time per step, which leaves out the
	// polls and counts the executor's cheap steps that commit nothing,
	// so it is a floor under the wait a call pays, not the wait.
	IntakeSteps   int64 `json:"intake_steps,omitempty"`
	ExecutorSteps int64 `json:"executor_steps,omitempty"`
}

func (u Usage) minus(v Usage) Usage {
	return Usage{
		Ledger: u.Ledger - v.Ledger, Store: u.Store - v.Store, Harness: u.Harness - v.Harness, Kafka: u.Kafka - v.Kafka,
		HarnessGC: u.HarnessGC - v.HarnessGC, Machine: u.Machine - v.Machine, Stolen: u.Stolen - v.Stolen,
		IntakeLoop: u.IntakeLoop - v.IntakeLoop, ExecutorLoops: u.ExecutorLoops - v.ExecutorLoops,
		IntakeSteps: u.IntakeSteps - v.IntakeSteps, ExecutorSteps: u.ExecutorSteps - v.ExecutorSteps,
	}
}

// openInterval is the timeline's interval in progress: what finish
// records into besides the run's totals. Guarded by run.mu.
type openInterval struct {
	e2e      Histogram
	stages   [4]Histogram
	finished int64
}

func (s *openInterval) record(e2e time.Duration, stages []time.Duration) {
	s.finished++
	s.e2e.Record(e2e)
	for k, d := range stages {
		s.stages[k].Record(d)
	}
}

// timeline closes an interval every cfg.TimelineEvery until done closes,
// and one last (shorter) interval then, so that the intervals cover the
// whole run including its drain. Run closes done once nothing else
// finishes calls.
func (r *run) timeline(start time.Time, done <-chan struct{}) []Interval {
	var (
		out       []Interval
		last      Usage
		submitted int64
	)
	if r.cfg.Usage != nil {
		last = r.cfg.Usage()
	}
	cut := func() {
		r.mu.Lock()
		s := &r.open
		// Read under the lock, with the counts: a tick's own time may
		// be well before a loaded machine runs this.
		iv := Interval{
			End: time.Since(start), Finished: s.finished, InFlight: len(r.waiting),
			E2E:       PercentilesOf(&s.e2e),
			IntakeP99: s.stages[0].Quantile(0.99), ClaimP99: s.stages[1].Quantile(0.99),
			CallP99: s.stages[2].Quantile(0.99), RecordP99: s.stages[3].Quantile(0.99),
		}
		n := r.submitted.Load()
		r.open = openInterval{}
		r.mu.Unlock()
		iv.Submitted, submitted = n-submitted, n
		if r.cfg.Usage != nil {
			u := r.cfg.Usage()
			d := u.minus(last)
			iv.Usage, last = &d, u
		}
		out = append(out, iv)
	}
	t := time.NewTicker(r.cfg.TimelineEvery)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			cut()
		case <-done:
			cut()
			return out
		}
	}
}

// cycle is a loop's mean cycle in an interval, in ms: its busy time over
// its steps; "-" without steps.
func cycle(busy time.Duration, steps int64) string {
	if steps <= 0 || busy <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f", msOf(busy/time.Duration(steps)))
}

// WriteTimeline writes each run's timeline as a table: a row an
// interval, the CPU as cores busy (CPU time over the interval's length).
func (rep Report) WriteTimeline(w io.Writer) error {
	for _, r := range rep.Runs {
		if len(r.Result.Timeline) == 0 {
			continue
		}
		fmt.Fprintf(w, "\ntimeline of %s (latencies of the calls finished in each interval, ms; CPU in cores; the loops' time in steps and transactions as a share of the interval, the executors' summed, and their busy time per step, ms; - where nothing was measured, or the interval was too short to measure):\n", r.Name)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "to s\tsubmitted\tfinished\tin flight\te2e p50\te2e p99\te2e max\tintake p99\tclaim p99\tcall p99\trecord p99\tledger\tstore\tharness\t(gc)\tkafka\tmachine\tstolen\tintake loop\texec loops\tintake cycle\texec cycle\t")
		var prev time.Duration
		for _, iv := range r.Result.Timeline {
			fmt.Fprintf(tw, "%.1f\t%d\t%d\t%d\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t",
				iv.End.Seconds(), iv.Submitted, iv.Finished, iv.InFlight,
				msOf(iv.E2E.P50), msOf(iv.E2E.P99), msOf(iv.E2E.Max),
				msOf(iv.IntakeP99), msOf(iv.ClaimP99), msOf(iv.CallP99), msOf(iv.RecordP99))
			// /proc counts CPU in 10 ms ticks: over a run's last,
			// short interval the quotient would be noise.
			if u, span := iv.Usage, iv.End-prev; u != nil && span >= 100*time.Millisecond {
				cores := func(d time.Duration) string {
					if d <= 0 {
						return "-"
					}
					return fmt.Sprintf("%.2f", d.Seconds()/span.Seconds())
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t\n", cores(u.Ledger), cores(u.Store), cores(u.Harness), cores(u.HarnessGC), cores(u.Kafka), cores(u.Machine), cores(u.Stolen),
					cores(u.IntakeLoop), cores(u.ExecutorLoops), cycle(u.IntakeLoop, u.IntakeSteps), cycle(u.ExecutorLoops, u.ExecutorSteps))
			} else {
				fmt.Fprint(tw, "-\t-\t-\t-\t-\t-\t-\t-\t-\t-\t-\t\n")
			}
			prev = iv.End
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	return nil
}
