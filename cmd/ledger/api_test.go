package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/ledger/token"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/projections/console"
	"github.com/toolcall-ledger/ledger/projections/httpapi"
	"github.com/toolcall-ledger/ledger/projections/projector"
)

// ledger api's /v1/health says the projection's lag when Kafka says it
// (0 for a projector that never committed), and that it is unknown, not
// 0, when Kafka refuses or does not answer within the bound; operators
// alone ask.
func TestAPIHealth(t *testing.T) {
	policy := func() string { return "v41@abc" }
	operator := httpapi.Operator{User: "u_ops", Tenant: "t_a", Roles: []string{console.RoleOperator}}
	for _, tc := range []struct {
		name    string
		lag     func(context.Context) (projector.GroupStatus, error)
		op      httpapi.Operator
		status  int
		records int64
		unknown bool
	}{
		{"known", func(context.Context) (projector.GroupStatus, error) {
			return projector.GroupStatus{Records: 12, Time: 3 * time.Second}, nil
		}, operator, 200, 12, false},
		{"never committed", func(context.Context) (projector.GroupStatus, error) {
			return projector.GroupStatus{Records: 7}, projector.ErrNeverCommitted
		}, operator, 200, 7, false},
		{"kafka refuses", func(context.Context) (projector.GroupStatus, error) {
			return projector.GroupStatus{}, errors.New("not authorized to describe group")
		}, operator, 200, 0, true},
		{"kafka silent", func(ctx context.Context) (projector.GroupStatus, error) {
			select {
			case <-ctx.Done(): // the bound ends
				return projector.GroupStatus{}, ctx.Err()
			case <-time.After(10 * time.Second): // no bound: a lag, too late
				return projector.GroupStatus{Records: 99}, nil
			}
		}, operator, 200, 0, true},
		{"not an operator", nil, httpapi.Operator{User: "u_a", Tenant: "t_a", Roles: []string{console.RoleApprover}}, 403, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec := httptest.NewRecorder()
			apiHealth(policy, tc.lag, 50*time.Millisecond, slog.New(slog.DiscardHandler))(rec, httptest.NewRequest(http.MethodGet, "/v1/health", nil), tc.op)
			if rec.Code != tc.status {
				t.Fatalf("status %d; want %d: %s", rec.Code, tc.status, rec.Body)
			}
			if tc.status != 200 {
				return
			}
			var h console.Health
			if err := json.Unmarshal(rec.Body.Bytes(), &h); err != nil {
				t.Fatal(err)
			}
			if h.Policy != "v41@abc" || h.ProjectionLagRecords != tc.records || h.ProjectionLagUnknown != tc.unknown || !h.BreakersUnknown {
				t.Errorf("health %+v; want policy v41@abc, lag %d records, unknown %v, breakers unknown (the executors')", h, tc.records, tc.unknown)
			}
		})
	}
}

// ledger api stays ready while Kafka does not answer: /healthz is 200, the
// kafka check failing it degraded only, since the questions and lookups
// (ClickHouse's) are what incident responders need most during such an
// outage, and a submission is answered 503 publish_failed by itself.
// Before, Kafka's outage took every replica out of its Service.
func TestAPIReadyWithoutKafka(t *testing.T) {
	cluster, cc, topics, _ := roleKfake(t)
	addr, _, exited := startAPIWithoutClickHouse(t, cc, topics)
	cluster.Close()
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		exited()
		resp, err := http.Get("http://" + addr + "/healthz")
		if err != nil {
			return err
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		var h struct {
			Status string            `json:"status"`
			Checks map[string]string `json:"checks"`
		}
		_ = json.Unmarshal(body, &h)
		if resp.StatusCode != http.StatusOK || h.Status != "degraded" || h.Checks["kafka"] != "unavailable" {
			return fmt.Errorf("healthz without Kafka: %d %s; want 200 degraded, saying kafka", resp.StatusCode, body)
		}
		return nil
	})
}

// ledger api starts and serves while ClickHouse does not answer: /healthz
// is 200, the clickhouse check failing it degraded only, and a question
// fails as in ClickHouse's outage. Before, it refused to start, and a pod
// restarted during such an outage took the submissions, approvals and
// kill switch down with the lookups.
func TestAPIStartsWithoutClickHouse(t *testing.T) {
	cc, topics, _ := roleCluster(t)
	addr, iss, _ := startAPIWithoutClickHouse(t, cc, topics)
	resp, err := http.Get("http://" + addr + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(body), "degraded") || !strings.Contains(string(body), "clickhouse") {
		t.Errorf("healthz without ClickHouse: %s; want degraded, saying clickhouse", body)
	}
	operator, err := iss.Mint(identity.Identity{Tenant: "t_demo", User: "u_ops", Agent: "test", Roles: []string{"operator"}}, identity.ApproverAudience, 10*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	req, _ := http.NewRequest(http.MethodGet, "http://"+addr+httpapi.PathTrace+"t_demo/k1", nil)
	req.Header.Set("Authorization", "Bearer "+operator)
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("a trace without ClickHouse = %d; want 503, as in its outage", resp.StatusCode)
	}
}

// startAPIWithoutClickHouse runs ledger api on the cluster cc with a
// ClickHouse address where nothing answers, and waits until its /healthz
// answers 200. It returns the API's address, the issuer of its identity
// keys, and runCommand's check that the command still runs.
func startAPIWithoutClickHouse(t *testing.T, cc ledger.ClientConfig, topics ledger.Topics) (addr string, iss *identity.Issuer, exited func()) {
	t.Helper()
	iss, jwks := devIssuerKeys(t, t.TempDir())
	addrs := freeAddrs(t, 2)
	addr, nobody := addrs[0], addrs[1]
	exited = runCommand(t, append(roleArgs(cc, topics), "api", "--http-addr", addr, "--clickhouse-dsn", "clickhouse://"+nobody,
		"--issuer", DevIssuer, "--jwks-file", jwks, "--secure-cookies=false")...)
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		exited()
		return healthz(addr)
	})
	return addr, iss, exited
}

// The console's sign-in says an assertion the staff verifier cannot judge
// now as such (console.ErrTryLater), and no other.
func TestSignInErrTryLater(t *testing.T) {
	forNow := &identity.ForNowError{Err: &token.Error{Reason: token.ReasonUnknownKID}, RetryAfter: time.Minute}
	if err := signInErr(forNow); !errors.Is(err, console.ErrTryLater) || token.ReasonOf(err) != token.ReasonUnknownKID {
		t.Errorf("for now: %v; want console.ErrTryLater, keeping unknown_kid", err)
	}
	if err := signInErr(&token.Error{Reason: token.ReasonBadSignature}); errors.Is(err, console.ErrTryLater) {
		t.Errorf("a bad signature: %v; want no ErrTryLater", err)
	}
	if err := signInErr(nil); err != nil {
		t.Errorf("no error: %v", err)
	}
}

// ledger api's agents' verifier says an assertion it cannot judge now
// as such (its keys stale, or an unknown kid not looked for in keys
// loaded since), for the API to answer 503 with its Retry-After rather
// than refuse the assertion; any other refusal, an unknown kid looked
// for included, keeps its reason.
func TestAgentOfStaleKeys(t *testing.T) {
	for _, tc := range []struct {
		reason string
		err    error
		after  time.Duration // 0: refused
	}{
		{identity.ReasonKeysStale, &identity.ForNowError{Err: &token.Error{Reason: identity.ReasonKeysStale}, RetryAfter: identity.StaleRetryAfter}, identity.StaleRetryAfter},
		{token.ReasonUnknownKID, &identity.ForNowError{Err: &token.Error{Reason: token.ReasonUnknownKID}, RetryAfter: 42 * time.Second}, 42 * time.Second},
		{token.ReasonUnknownKID, &token.Error{Reason: token.ReasonUnknownKID}, 0},
		{"expired", errors.New("expired"), 0},
	} {
		_, err := agentOf(identity.Identity{}, tc.reason, tc.err)
		e, forNow := errors.AsType[*httpapi.CannotVerifyNowError](err)
		switch {
		case tc.after != 0 && (!forNow || !errors.Is(err, httpapi.ErrCannotVerifyNow) || e.Reason != tc.reason || e.RetryAfter != tc.after):
			t.Errorf("%v: %v; want httpapi.ErrCannotVerifyNow, %s, after %v", tc.err, err, tc.reason, tc.after)
		case tc.after == 0 && (err == nil || errors.Is(err, httpapi.ErrCannotVerifyNow) || err.Error() != tc.reason):
			t.Errorf("%v: %v; want refused %s", tc.err, err, tc.reason)
		}
	}
}
