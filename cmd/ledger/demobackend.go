package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sync/errgroup"

	"github.com/toolcall-ledger/ledger/processors/credentials"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
)

// demoBackendFlags configure `ledger demo-backend`.
type demoBackendFlags struct {
	addr       string
	latency    time.Duration
	jwksURLs   []string
	introspect string
	journal    string
}

func newDemoBackendCmd(g *globals) *cobra.Command {
	var f demoBackendFlags
	cmd := &cobra.Command{
		Use:   "demo-backend",
		Short: "Serve the demo tools on their own, recording every effect: a downstream for a deployment to call and for ledger bench --attach to count",
		Long: `demo-backend serves the demo tools that ledger dev serves in its own process
(get_weather, create_ticket, refund_order and the rest, with their status
lookups), for a deployment of separate intake and executor processes to
call (the executors' --tools-base-url). It applies each effect once per
idempotency key where the tool is native-idempotent, as a real downstream
would, and records every effect it applied: GET /effects lists them, which
is where ledger bench --attach counts duplicate and missing effects.

With --credential-jwks-url (every executor's --jwks-addr, and the
reconciler's, comma separated) every request must carry the per-call
credential the ledger minted for it, as a deployed tool checks; without,
none is checked. It is a stand-in for real tools, for
trials and benchmarks: it keeps every effect in memory until it stops.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runDemoBackend(cmd.Context(), g, &f, cmd.OutOrStdout())
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&f.addr, "addr", "127.0.0.1:8081", "where to serve the tools (POST /tools/{tool}, GET /tools/{tool}/status, GET /effects, GET /healthz)")
	fs.DurationVar(&f.latency, "latency", 0, "latency added to every tool request, to model a real downstream")
	fs.StringSliceVar(&f.jwksURLs, "credential-jwks-url", nil, "the ledger's credential keys, comma separated: the /.well-known/jwks.json of every executor's --jwks-addr and of the reconciler's (each signs with keys of its own); with it every request must carry a credential minted for it (401 otherwise); each https, or http on loopback, and not followed when it redirects")
	fs.StringVar(&f.introspect, "introspect-url", "", "with --credential-jwks-url: the ledger's token introspection endpoint (a reconciler's /v1/introspect), asked about every credential so that a revoked one is refused; https, or http on loopback")
	fs.StringVar(&f.journal, "journal", "", "also append every effect to this file, one JSON line each; the effects already in it are the backend's state when it starts (a key applied before is replayed, not applied again), so one backend per file")
	return cmd
}

func runDemoBackend(ctx context.Context, g *globals, f *demoBackendFlags, out io.Writer) error {
	logger := g.logger().With("component", "demobackend")
	cfg := demobackend.Config{Logger: logger, Latency: f.latency, JournalPath: f.journal}
	checks := "no credential checked"
	switch {
	case len(f.jwksURLs) > 0:
		hc, err := g.httpClient.client(logger, 10*time.Second)
		if err != nil {
			return fmt.Errorf("demo-backend: %w", err)
		}
		v, err := credentials.NewVerifier(credentials.VerifierConfig{Audience: demobackend.DefaultAudience, JWKSURLs: f.jwksURLs, HTTPClient: hc, Logger: logger})
		if err != nil {
			return fmt.Errorf("demo-backend: --credential-jwks-url: %w", err)
		}
		if cfg.IntrospectTransport, err = g.httpClient.transport(logger, 0); err != nil {
			return fmt.Errorf("demo-backend: %w", err)
		}
		if f.introspect != "" {
			if err := (&credentials.Introspector{URL: f.introspect}).Check(); err != nil {
				return fmt.Errorf("demo-backend: --introspect-url: %w", err)
			}
		}
		cfg.Credentials, cfg.IntrospectURL = v, f.introspect
		checks = "credentials checked against " + strings.Join(f.jwksURLs, ", ")
	case f.introspect != "":
		return fmt.Errorf("demo-backend: --introspect-url asks about the credentials that --credential-jwks-url verifies")
	}
	backend, err := demobackend.Open(cfg)
	if err != nil {
		return err
	}
	defer backend.Close()
	grp, gctx := errgroup.WithContext(ctx)
	addr, err := g.serve(gctx, grp, "demo-backend", f.addr, backend.Handler())
	if err != nil {
		return err
	}
	scheme := "http"
	if g.httpTLS.enabled() {
		scheme = "https"
	}
	fmt.Fprintf(out, "demo backend: serving the demo tools on %s://%s (%s); GET /effects lists every effect it applied since it started\n", scheme, addr, checks)
	return grp.Wait()
}
