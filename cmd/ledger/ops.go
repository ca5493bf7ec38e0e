package main

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"net/http/pprof"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors/metrics"
)

// readyCheck is one dependency /readyz looks at.
type readyCheck struct {
	name string
	fn   func(context.Context) error
}

// readyTimeout bounds one check of one /readyz request: a probe answers
// within a probe's timeout even when a dependency hangs.
const readyTimeout = 2 * time.Second

// readiness answers /readyz: 200 when every check passes, 503 with the
// failing ones otherwise, as JSON either way.
type readiness struct {
	checks []readyCheck
	logger *slog.Logger
}

type readyResult struct {
	Name  string `json:"name"`
	OK    bool   `json:"ok"`
	Error string `json:"error,omitempty"`
}

func (rd readiness) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	results := make([]readyResult, len(rd.checks))
	var wg sync.WaitGroup
	for i, c := range rd.checks {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(r.Context(), readyTimeout)
			defer cancel()
			results[i] = readyResult{Name: c.name, OK: true}
			if err := c.fn(ctx); err != nil {
				results[i] = readyResult{Name: c.name, Error: err.Error()}
			}
		})
	}
	wg.Wait()
	ready := true
	for _, res := range results {
		if !res.OK {
			ready = false
			rd.logger.Warn("not ready", "check", res.Name, "err", res.Error)
		}
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	if !ready {
		w.WriteHeader(http.StatusServiceUnavailable)
	}
	_ = json.NewEncoder(w).Encode(struct {
		Ready  bool          `json:"ready"`
		Checks []readyResult `json:"checks"`
	}{ready, results})
}

// pinger is a store that can say whether its database answers.
type pinger interface {
	Ping(ctx context.Context) error
}

// loopsPath serves how a process's loops have spent their time.
const loopsPath = "/loops"

// loopsHandler serves GET /loops: each loop's time in steps and
// transactions so far (ledger.Loop.Time), by name ("intake",
// "executor", "executor-1"...), for ledger bench's timeline, which
// reads it every second.
func loopsHandler(names []string, loops []*ledger.Loop) http.HandlerFunc {
	return func(w http.ResponseWriter, _ *http.Request) {
		times := make(map[string]ledger.LoopTime, len(loops))
		for i, l := range loops {
			times[names[i]] = l.Time()
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(times)
	}
}

// pprofPrefix is where --pprof serves the runtime's profiles.
const pprofPrefix = "/debug/pprof/"

// servePprof adds net/http/pprof's pages to mux, for go tool pprof. They
// are added one by one: the package's init puts them on
// http.DefaultServeMux, which nothing here serves. The command line page
// is left out, because a command line may hold a secret (a SASL password
// given as a flag).
func servePprof(mux *http.ServeMux) {
	mux.HandleFunc("GET "+pprofPrefix, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == pprofPrefix+"cmdline" {
			http.NotFound(w, r)
			return
		}
		pprof.Index(w, r)
	})
	mux.HandleFunc("GET "+pprofPrefix+"profile", pprof.Profile)
	mux.HandleFunc("GET "+pprofPrefix+"trace", pprof.Trace)
	mux.HandleFunc("GET "+pprofPrefix+"symbol", pprof.Symbol)
	mux.HandleFunc("POST "+pprofPrefix+"symbol", pprof.Symbol)
}

// processChecks are the /readyz checks of a process running loops: each
// loop works (under its name in names), the Kafka cluster answers (when
// kafka is set), the store does (when it can be pinged), and the extra
// checks pass.
func processChecks(names []string, loops []*ledger.Loop, kafka *kgo.Client, store any, extra ...readyCheck) []readyCheck {
	var checks []readyCheck
	for i, l := range loops {
		checks = append(checks, readyCheck{names[i], func(context.Context) error { return l.Ready() }})
	}
	if kafka != nil {
		checks = append(checks, readyCheck{"kafka", kafka.Ping})
	}
	if p, ok := store.(pinger); ok {
		checks = append(checks, readyCheck{"store", p.Ping})
	}
	return append(checks, extra...)
}

// opsServer is a role's operational endpoint: /metrics, /healthz (the
// process serves), /readyz (its dependencies answer and its loop works)
// and /loops (its loop's time, see loopsHandler).
type opsServer struct {
	srv *http.Server
	// admin, when set, is the client of the Kafka checks and lag,
	// closed by stop.
	admin *kgo.Client
	done  chan struct{}
}

// startOps serves reg and the readiness of loop, the Kafka cluster,
// store (when it can be pinged) and the extra checks on addr, until stop, and with profiles the
// runtime's profiles (servePprof). It listens before it returns, so a
// taken port fails the role's start. It also reports the loop's
// consumer-group lag.
func startOps(g *globals, addr string, profiles bool, role string, reg *metrics.Registry, loop *ledger.Loop, store any, logger *slog.Logger, extra ...readyCheck) (*opsServer, error) {
	admin, err := ledger.NewClient(g.kafka.client(logger))
	if err != nil {
		return nil, err
	}
	reg.ConsumerLag(kadm.NewClient(admin), loop.Group(), logger)
	checks := processChecks([]string{"loop"}, []*ledger.Loop{loop}, admin, store, extra...)
	mux := opsMux(reg, checks, profiles, logger)
	mux.Handle("GET "+loopsPath, loopsHandler([]string{role}, []*ledger.Loop{loop}))
	o, err := listenOps(g, addr, role, mux, logger)
	if err != nil {
		admin.Close()
		return nil, err
	}
	o.admin = admin
	return o, nil
}

// opsMux serves reg at /metrics, /healthz, checks at /readyz, and with
// profiles the runtime's profiles (servePprof).
func opsMux(reg *metrics.Registry, checks []readyCheck, profiles bool, logger *slog.Logger) *http.ServeMux {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", reg.Handler())
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.Handle("GET /readyz", readiness{checks: checks, logger: logger.With("server", "ops")})
	if profiles {
		servePprof(mux)
	}
	return mux
}

// listenOps serves mux on addr until stop. It listens before it
// returns, so a taken port fails the role's start.
func listenOps(g *globals, addr, role string, mux *http.ServeMux, logger *slog.Logger) (*opsServer, error) {
	o := &opsServer{srv: newServer(addr, mux), done: make(chan struct{})}
	serve, err := g.httpTLS.listen(o.srv, logger.With("server", "ops", "role", role))
	if err != nil {
		return nil, err
	}
	go func() {
		defer close(o.done)
		if err := serve(); !errors.Is(err, http.ErrServerClosed) {
			logger.Error("ops server stopped", "addr", addr, "err", err)
		}
	}()
	return o, nil
}

// stop shuts the server down, letting a scrape in progress finish.
func (o *opsServer) stop() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = o.srv.Shutdown(ctx)
	<-o.done
	if o.admin != nil {
		o.admin.Close()
	}
}
