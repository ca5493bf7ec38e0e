package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors/credentials"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/processors/httptool"
)

// startDemoBackend runs `ledger demo-backend` in process with args and
// waits until it answers on addr.
func startDemoBackend(t *testing.T, addr string, args ...string) {
	t.Helper()
	exited := runCommand(t, append([]string{"--log-level", "warn", "demo-backend", "--addr", addr}, args...)...)
	ledgertest.WaitFor(t, 10*time.Second, func() error {
		exited()
		return healthz(addr)
	})
}

// `ledger demo-backend` serves the demo tools on their own: a call's
// effect is applied once per idempotency key, listed at GET /effects and
// in the journal; with the ledger's credential keys (those of two
// executors, each with its own), a call without a credential minted for
// it is refused without an effect, and either executor's credential is
// accepted.
func TestDemoBackendCommand(t *testing.T) {
	brokers, urls := servedBrokers(t, 2)
	for _, checked := range []bool{false, true} {
		t.Run(fmt.Sprintf("credentials checked %v", checked), func(t *testing.T) {
			addr := freeAddr(t)
			journal := filepath.Join(t.TempDir(), "effects.jsonl")
			args := []string{"--journal", journal}
			if checked {
				args = append(args, "--credential-jwks-url", strings.Join(urls, ","))
			}
			startDemoBackend(t, addr, args...)
			cl := httptool.New(httptool.Config{})
			call := func(key, credential string) error {
				_, err := cl.Call(t.Context(), httptool.Request{
					URL: "http://" + addr + "/tools/create_ticket", IdempotencyKey: key, TenantID: "t_a",
					CallID: "call_" + key, Attempt: 1, Arguments: []byte(`{"title":"printer on fire"}`), Credential: credential,
				})
				return err
			}
			var cred string
			if checked {
				var te *httptool.Error
				if err := call("k-none", ""); !errors.As(err, &te) || te.Status != http.StatusUnauthorized {
					t.Errorf("a call without a credential: %v; want 401", err)
				}
				c, err := brokers[0].Mint(credentials.Grant{Tenant: "t_a", User: "u", Agent: "a", Executor: "e", Tool: "create_ticket", ToolVersion: 1,
					Audience: demobackend.DefaultAudience, CallID: "call_k-1", IdempotencyKey: "k-1"})
				if err != nil {
					t.Fatal(err)
				}
				cred = c.Token
				// The other executor's credential, for a call of its own.
				c2, err := brokers[1].Mint(credentials.Grant{Tenant: "t_a", User: "u", Agent: "a", Executor: "e2", Tool: "create_ticket", ToolVersion: 1,
					Audience: demobackend.DefaultAudience, CallID: "call_k-2", IdempotencyKey: "k-2"})
				if err != nil {
					t.Fatal(err)
				}
				if err := call("k-2", c2.Token); err != nil {
					t.Errorf("a call with the second executor's credential: %v; want accepted", err)
				}
			}
			// A retry with the same key does not apply the effect again.
			for range 2 {
				if err := call("k-1", cred); err != nil {
					t.Fatalf("a call: %v", err)
				}
			}
			resp, err := http.Get("http://" + addr + "/effects")
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			var effects []demobackend.Effect
			if err := json.NewDecoder(resp.Body).Decode(&effects); err != nil {
				t.Fatal(err)
			}
			applied := 0
			for _, ef := range effects {
				if ef.IdempotencyKey == "k-none" {
					t.Errorf("the refused call has an effect: %+v", ef)
				}
				if ef.IdempotencyKey == "k-1" && !ef.Replay && !ef.Read {
					applied++
				}
			}
			if applied != 1 {
				t.Errorf("effects %+v; want create_ticket applied once for k-1", effects)
			}
			b, err := os.ReadFile(journal)
			if err != nil || !strings.Contains(string(b), `"k-1"`) {
				t.Errorf("journal %q (%v); want the effect in it", b, err)
			}
		})
	}
	// The introspection endpoint asks about credentials that are verified.
	root := newRoot()
	root.SetArgs([]string{"demo-backend", "--addr", freeAddr(t), "--introspect-url", "http://127.0.0.1:1/v1/introspect"})
	root.SetOut(io.Discard)
	root.SetErr(io.Discard)
	if err := root.ExecuteContext(t.Context()); err == nil || !strings.Contains(err.Error(), "--credential-jwks-url") {
		t.Errorf("--introspect-url alone: %v; want it refused, naming --credential-jwks-url", err)
	}
}
