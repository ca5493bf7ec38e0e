package processors_test

// Issue 5's kill switch end to end: freezes reach every instance within a
// second under load, and revoked credentials are refused by the tool.

import (
	"context"
	"errors"
	"fmt"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors/control"
	"github.com/toolcall-ledger/ledger/processors/credentials"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/processors/httptool"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/processors/intake"
	"github.com/toolcall-ledger/ledger/processors/policy"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// ops is a platform operator.
var ops = identity.Identity{User: "u_ops", Agent: "console", Tenant: control.PlatformTenant, Roles: []string{"operator"}}

// controlState follows the harness's control topic, as each instance does.
func (h *harness) controlState(name string) *control.State {
	h.t.Helper()
	st := control.NewState(h.logger)
	h.run(name, func(ctx context.Context) error { return st.Run(ctx, h.kafka.Client, h.kafka.Topics.Control) })
	select {
	case <-st.Ready():
	case <-time.After(30 * time.Second):
		h.t.Fatalf("%s: control state not ready", name)
	}
	return st
}

func (h *harness) controlService(st *control.State, inspector control.Inspector) *control.Service {
	h.t.Helper()
	svc, err := control.New(control.Config{State: st, Publisher: kafkaPublisher{h.pub}, Identity: h.ident.Verifier, Topics: h.kafka.Topics, Credentials: inspector, Logger: h.logger})
	if err != nil {
		h.t.Fatal(err)
	}
	return svc
}

// Under a sustained load of 500 calls/s, a freeze stops every effect on
// the tool that would start more than a second after it, in an intake and
// an executor that each follow the control topic on their own; every call
// still ends, succeeded or refused or denied tool_frozen.
func TestFreezeUnderLoad(t *testing.T) {
	h := newHarness(t, storeSQL, 12)
	// Each processor follows the topic itself, as separate instances do.
	intakeControls, execControls := h.controlState("intake-controls"), h.controlState("executor-controls")
	in, err := intake.New(intake.Config{
		Registry: h.reg, Store: h.store, Topics: h.kafka.Topics, Actor: "intake-1", Logger: h.logger,
		Identity: h.ident.Verifier, Policy: h.policy, Freezes: intakeControls,
	})
	if err != nil {
		t.Fatal(err)
	}
	loop, err := in.Loop(ledger.LoopConfig{Client: h.kafka.Client, Group: h.kafka.Group("intake"), Tick: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	h.run("intake-1", loop.Run)
	cfg := h.executorConfig("executor-1")
	cfg.Freezes = execControls
	h.startExecutor(cfg)
	svc := h.controlService(h.controlState("operator-controls"), nil)

	const rate, seconds = 500, 4
	assertion := h.ident.Assertion(t, "t_a", "u_1")
	var (
		mu   sync.Mutex
		keys []ledger.CallKey
	)
	load := make(chan struct{})
	go func() {
		// Owned by the test: it publishes rate calls a second for
		// seconds seconds, in ticks of 10ms, then closes load.
		defer close(load)
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		start := time.Now()
		sent := 0
		for time.Since(start) < seconds*time.Second {
			<-tick.C
			due := int(time.Since(start).Seconds() * rate)
			var batch []envelope
			for ; sent < due; sent++ {
				e := h.newEnvelopeSigned("t_a", fmt.Sprintf("load-%05d", sent), "create_ticket", map[string]any{"title": "load"}, assertion)
				batch = append(batch, e)
			}
			h.submit(batch...)
			mu.Lock()
			for _, e := range batch {
				keys = append(keys, e.key())
			}
			mu.Unlock()
		}
	}()
	// Freeze halfway, once the load runs.
	waitEffects(h, rate)
	if _, err := svc.Freeze(t.Context(), ops, "create_ticket", "", "incident under load"); err != nil {
		t.Fatal(err)
	}
	frozenAt := time.Now()
	<-load

	mu.Lock()
	all := append([]ledger.CallKey(nil), keys...)
	mu.Unlock()
	if len(all) < rate*seconds*9/10 {
		t.Fatalf("published %d calls; want about %d", len(all), rate*seconds)
	}
	outcomes := map[string]int{}
	ledgertest.WaitFor(t, 2*time.Minute, func() error {
		clear(outcomes)
		for _, k := range all {
			c, err := h.index.Get(k)
			switch {
			case err == nil && len(c.Refusals) > 0:
				outcomes["refused "+c.Refusals[0].Reason]++
			case err == nil && c.Settled():
				last := c.Events[len(c.Events)-1]
				outcomes[string(c.State)+" "+last.Reason]++
			default:
				return fmt.Errorf("%s has not ended", k)
			}
		}
		return nil
	})
	late := 0
	for _, e := range h.backend.Effects() {
		// Received: when the executor's request reached the tool, that
		// is, when it started the effect.
		if e.Tool == "create_ticket" && e.Received.After(frozenAt.Add(time.Second)) {
			late++
		}
	}
	if late != 0 {
		t.Errorf("%d effects started more than 1s after the freeze; want 0", late)
	}
	if outcomes["refused "+intake.ReasonToolFrozen] == 0 {
		t.Errorf("no call was refused as frozen: %v", outcomes)
	}
	// What the agents (and their models) read of the freeze: the tool and
	// since when, not who froze it nor why (a platform operator's reason
	// may speak of other tenants).
	for _, k := range all {
		c, _ := h.index.Get(k)
		var ev ledger.Event
		switch {
		case len(c.Refusals) > 0:
			ev = c.Refusals[0]
		case len(c.Events) > 0:
			ev = c.Events[len(c.Events)-1]
		}
		if ev.Reason != intake.ReasonToolFrozen {
			continue
		}
		if !strings.HasPrefix(ev.Detail, "create_ticket is frozen for every tenant since ") || strings.Contains(ev.Detail, "incident") || strings.Contains(ev.Detail, ops.User) {
			t.Errorf("%s's %s detail %q; want the tool and since when alone", k, ev.Type, ev.Detail)
			break
		}
	}
	for o := range outcomes {
		switch o {
		case "succeeded ", "refused " + intake.ReasonToolFrozen, "denied tool_frozen":
		default:
			t.Errorf("unexpected outcome %q (%d calls)", o, outcomes[o])
		}
	}
	t.Logf("%d calls at %d/s, frozen after %d effects: %v", len(all), rate, rate, outcomes)
}

// A revoked credential is refused by the tool within a second, whether its
// jti or its family was revoked.
func TestRevokedCredentialRefusedByTool(t *testing.T) {
	broker, err := credentials.New(credentials.Config{})
	if err != nil {
		t.Fatal(err)
	}
	inspector, err := credentials.NewVerifier(credentials.VerifierConfig{Keys: broker.Keys})
	if err != nil {
		t.Fatal(err)
	}
	toolVerifier, err := credentials.NewVerifier(credentials.VerifierConfig{Audience: demobackend.DefaultAudience, Keys: broker.Keys})
	if err != nil {
		t.Fatal(err)
	}
	h := newHarness(t, storeSQL, 4)
	svc := h.controlService(h.controlState("controls"), inspector)
	api := httptest.NewServer(svc.Handler())
	t.Cleanup(api.Close)
	tool := demobackend.New(demobackend.Config{Credentials: toolVerifier, IntrospectURL: api.URL + control.IntrospectPath})
	toolSrv := httptest.NewServer(tool.Handler())
	t.Cleanup(func() { tool.Close(); toolSrv.Close() })
	caller := httptool.New(httptool.Config{})

	for _, by := range []string{"jti", "family"} {
		t.Run(by, func(t *testing.T) {
			key := "t_a/revoke-" + by
			cred, err := broker.Mint(credentials.Grant{
				Tenant: "t_a", User: "u_1", Agent: "agent", Executor: "executor-1", Tool: "create_ticket", ToolVersion: 1,
				Audience: demobackend.DefaultAudience, CallID: "c", IdempotencyKey: key,
			})
			if err != nil {
				t.Fatal(err)
			}
			call := func() error {
				_, err := caller.Call(t.Context(), httptool.Request{URL: toolSrv.URL + "/tools/create_ticket", IdempotencyKey: key, TenantID: "t_a", CallID: "c", Attempt: 1, Arguments: []byte(`{"title":"t"}`), Credential: cred.Token})
				return err
			}
			if err := call(); err != nil {
				t.Fatalf("before the revocation: %v", err)
			}
			jti, family := cred.JTI, ""
			if by == "family" {
				jti, family = "", cred.Family
			}
			if _, err := svc.Revoke(t.Context(), ops, jti, family, "leaked"); err != nil {
				t.Fatal(err)
			}
			revokedAt := time.Now()
			ledgertest.WaitFor(t, 5*time.Second, func() error {
				if err := call(); err == nil {
					return fmt.Errorf("still accepted")
				}
				return nil
			})
			if d := time.Since(revokedAt); d > time.Second {
				t.Errorf("the tool refused the revoked credential after %s; want within 1s", d)
			}
			refused := false
			for _, r := range tool.Refusals() {
				if r.IdempotencyKey == key && r.Reason == demobackend.ReasonRevoked {
					refused = true
				}
			}
			if !refused {
				t.Errorf("the tool's refusals %+v lack %s for %s", tool.Refusals(), demobackend.ReasonRevoked, key)
			}
		})
	}
}

// An operator activates a policy version on the control topic; an intake
// following the activations decides the next call with it.
func TestPolicyVersionActivatedThroughControl(t *testing.T) {
	root := t.TempDir()
	for label, src := range map[string]string{
		"v1": `@id("weather") permit (principal, action == Action::"tool::get_weather", resource);`,
		"v2": `@id("weather") permit (principal, action == Action::"tool::get_weather", resource);
@id("no-weather") forbid (principal, action == Action::"tool::get_weather", resource);`,
	} {
		if err := os.MkdirAll(filepath.Join(root, label), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, label, "policy.cedar"), []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	h := newHarness(t, storeSQL, 4)
	controls := h.controlState("controls")
	h.run("activations", func(ctx context.Context) error {
		return h.policy.FollowActivations(ctx, root, controls.PolicyActivation, 20*time.Millisecond)
	})
	h.startIntake("intake-1")
	h.startExecutor(h.executorConfig("executor-1"))
	svc := h.controlService(controls, nil)
	tenantOps := identity.Identity{User: "u_ops", Tenant: "t_a", Roles: []string{"operator"}}
	if _, err := svc.ActivatePolicy(t.Context(), tenantOps, "v2", "", "try"); err == nil {
		t.Errorf("a tenant operator activated a policy version")
	}
	if _, err := svc.ActivatePolicy(t.Context(), ops, "v1", "sha256:abc", "try"); !errors.Is(err, control.ErrInvalidRequest) {
		t.Errorf("activation pinning a malformed hash: %v; want %v", err, control.ErrInvalidRequest)
	}
	hash := map[string]string{}
	for _, label := range []string{"v1", "v2"} {
		set, err := policy.LoadDir(filepath.Join(root, label), label)
		if err != nil {
			t.Fatal(err)
		}
		hash[label] = set.Hash()
	}
	// The label alone, then each pinned: v1 pinned to v2's content is
	// not what v1's files are, and decides nothing (no set is active:
	// calls are refused for now).
	for i, tc := range []struct {
		label, pin string
		state      statemachine.State
		reason     string
	}{
		{"v1", "", statemachine.StateSucceeded, ""},
		{"v2", "", statemachine.StateDenied, policy.ReasonDeniedByPolicy},
		{"v1", hash["v2"], statemachine.StateDenied, policy.ReasonUnavailable},
		{"v1", hash["v1"], statemachine.StateSucceeded, ""},
	} {
		if _, err := svc.ActivatePolicy(t.Context(), ops, tc.label, tc.pin, "rollout"); err != nil {
			t.Fatal(err)
		}
		ledgertest.WaitFor(t, 5*time.Second, func() error {
			v := h.policy.Active().Version()
			if (tc.reason == policy.ReasonUnavailable) != (v == "") || (v != "" && !strings.HasPrefix(v, tc.label+"@")) {
				return fmt.Errorf("engine at %q", v)
			}
			return nil
		})
		e := h.newEnvelope("t_a", fmt.Sprintf("activated-%d", i), "get_weather", map[string]any{"city": "Oslo"})
		h.submit(e)
		if tc.reason == policy.ReasonUnavailable {
			// Not decided: refused for now, its key left free.
			if ref := h.waitRefused(30*time.Second, e.key()); ref.Reason != tc.reason {
				t.Errorf("under %s pinned to v2's content: refused %s (%s); want %s", tc.label, ref.Reason, ref.Detail, tc.reason)
			}
			if err := h.policy.Err(); err == nil || !strings.Contains(err.Error(), hash["v1"]) || !strings.Contains(err.Error(), hash["v2"]) {
				t.Errorf("the engine's error: %v; want both the files' hash and the pinned one", err)
			}
			continue
		}
		c := h.waitSettled(30*time.Second, e.key())[e.key()]
		last := c.Events[len(c.Events)-1]
		if c.State != tc.state || last.Reason != tc.reason {
			t.Errorf("under %s pinned %q: %s (%s); want %s (%s)", tc.label, tc.pin, c.State, last.Reason, tc.state, tc.reason)
		}
		if v := c.Events[1].PolicyVersion; !strings.HasPrefix(v, tc.label+"@") {
			t.Errorf("under %s pinned %q: decided at %s; want %s@…", tc.label, tc.pin, v, tc.label)
		}
	}
}
