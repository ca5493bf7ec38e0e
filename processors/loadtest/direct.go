package loadtest

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"sync/atomic"
	"time"
)

// DirectConfig configures the floor: the same calls made straight to the
// tools, without the ledger.
type DirectConfig struct {
	Tools       []Tool
	Calls       int64
	Concurrency int
	Tenants     int
	RunID       string
	// Call makes one call to the tool's backend.
	Call func(ctx context.Context, tool Tool, tenant, key string, args []byte) error
}

// DirectReport is the floor measured.
type DirectReport struct {
	Calls   int64         `json:"calls"`
	Errors  int64         `json:"errors"`
	Elapsed time.Duration `json:"elapsed_ns"`
	PerSec  float64       `json:"calls_per_sec"`
	Latency Percentiles   `json:"latency"`
	// Note says what the reader must know of the backend the calls went
	// to, when it was not the one the ledger's tools called; "" when it
	// was.
	Note string `json:"note,omitempty"`
}

// Direct makes cfg.Calls calls from cfg.Concurrency workers, closed loop,
// the tools picked and the tenants assigned as Run picks them.
func Direct(ctx context.Context, cfg DirectConfig) (DirectReport, error) {
	if cfg.Call == nil || len(cfg.Tools) == 0 || cfg.Calls <= 0 || cfg.Concurrency <= 0 {
		return DirectReport{}, errors.New("loadtest: direct needs Call, Tools, and positive Calls and Concurrency")
	}
	if cfg.Tenants <= 0 {
		cfg.Tenants = 8
	}
	mix := newMix(cfg.Tools)
	var (
		next   atomic.Int64
		errs   atomic.Int64
		mu     sync.Mutex
		hist   = NewHistogram()
		wg     sync.WaitGroup
		first  error
		start  = time.Now()
		cancel context.CancelFunc
	)
	ctx, cancel = context.WithCancel(ctx)
	defer cancel()
	for range cfg.Concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				i := next.Add(1) - 1
				if i >= cfg.Calls {
					return
				}
				tool := mix.pick(i)
				args, err := json.Marshal(tool.Args(i))
				if err == nil {
					t0 := time.Now()
					err = cfg.Call(ctx, tool, tenantName(int(i%int64(cfg.Tenants))), callKey(cfg.RunID, i), args)
					d := time.Since(t0)
					mu.Lock()
					hist.Record(d)
					mu.Unlock()
				}
				if err != nil {
					if errs.Add(1) == 1 {
						mu.Lock()
						first = err
						mu.Unlock()
					}
				}
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	rep := DirectReport{Calls: hist.Count(), Errors: errs.Load(), Elapsed: elapsed, Latency: PercentilesOf(hist)}
	rep.PerSec = float64(rep.Calls-rep.Errors) / elapsed.Seconds()
	if first != nil {
		return rep, first
	}
	return rep, ctx.Err()
}

// mix picks a call's tool by weight, spread evenly over the calls.
type mix struct {
	tools   []Tool
	weights []int // cumulative
}

func newMix(tools []Tool) mix {
	m := mix{tools: tools}
	total := 0
	for _, t := range tools {
		total += t.Weight
		m.weights = append(m.weights, total)
	}
	return m
}

func (m mix) pick(i int64) Tool {
	p := int((i * 7919) % int64(m.weights[len(m.weights)-1]))
	ti := 0
	for p >= m.weights[ti] {
		ti++
	}
	return m.tools[ti]
}
