package main

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"golang.org/x/sync/errgroup"

	"github.com/toolcall-ledger/ledger/processors/approvals"
	"github.com/toolcall-ledger/ledger/processors/httptool"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/processors/metrics"
	"github.com/toolcall-ledger/ledger/projections/httpapi"
	"github.com/toolcall-ledger/ledger/projections/report"
)

// staffFlags say where the API is and who the approver or operator is.
type staffFlags struct {
	g *globals
	// hc is the command's HTTP client, made at its first request.
	hc        *http.Client
	api       string
	assertion string
	dataDir   string
	tenant    string
	user      string
	jsonOut   bool
	// flags are the command's own, to tell --tenant and --user given
	// from their defaults.
	flags *pflag.FlagSet
}

func (f *staffFlags) register(cmd *cobra.Command) {
	fs := cmd.PersistentFlags()
	f.flags = fs
	fs.StringVar(&f.api, "api", "http://"+devHTTPAddr, "the ledger's HTTP API: https, or http on loopback only (the requests carry the assertion)")
	fs.StringVar(&f.assertion, "assertion", "", "the approver's assertion (a JWT with the approver role); default: minted by the dev issuer in --data-dir")
	fs.StringVar(&f.dataDir, "data-dir", devDataDir, "data directory of 'ledger dev', whose dev issuer mints the approver's assertion")
	// dev takes its directory from its command line alone: so does
	// whatever finds dev's issuer in it.
	ignoreEnv(fs, "data-dir")
	fs.StringVar(&f.tenant, "tenant", "t_demo", "the approver's tenant, for a dev assertion minted here (given on the command line with --assertion, which names its own, it is refused; from the environment it is then ignored, as LEDGER_TENANT and LEDGER_USER may be set for other commands)")
	fs.StringVar(&f.user, "user", "u_approver", "the approver, for a dev assertion minted here (given on the command line with --assertion, which names its own, it is refused; from the environment it is then ignored, as LEDGER_TENANT and LEDGER_USER may be set for other commands)")
	fs.BoolVar(&f.jsonOut, "json", false, "print JSON")
}

// approverAgent is the agent of the dev assertions that staff commands
// and ledger token --approver mint: not ledger submit's (agent_cli), for
// the approval queue refuses an approver acting through the agent that
// requested the call.
const approverAgent = "approver_cli"

// bearer returns the approver's assertion.
func (f *staffFlags) bearer() (string, error) {
	if f.assertion != "" {
		// Ignored with an assertion, which says who acts: an operator
		// who took --tenant for the tenant to act on (control's is
		// --for-tenant) would act on another scope, every tenant's.
		var given []string
		for _, n := range []string{"tenant", "user"} {
			if fl := f.flags.Lookup(n); fl != nil && fl.Changed {
				given = append(given, "--"+n)
			}
		}
		if len(given) > 0 {
			return "", fmt.Errorf("%s: only for a dev assertion, minted here; --assertion (or LEDGER_ASSERTION) already says who you are and of which tenant (to act on one tenant's tools as a platform operator: ledger control freeze|unfreeze --for-tenant)", strings.Join(given, ", "))
		}
		return f.assertion, nil
	}
	iss, err := devIssuer(f.dataDir)
	if err != nil {
		return "", fmt.Errorf("no --assertion, and %v", err)
	}
	return iss.Mint(identity.Identity{Tenant: f.tenant, User: f.user, Agent: approverAgent, Roles: []string{"approver", "operator"}}, identity.ApproverAudience, 5*time.Minute)
}

// call makes one API request as the approver and decodes the answer.
func (f *staffFlags) call(ctx context.Context, method, path string, body, into any) error {
	_, err := f.callStatus(ctx, method, path, body, into)
	return err
}

// callStatus is call, with the answer's status.
func (f *staffFlags) callStatus(ctx context.Context, method, path string, body, into any) (int, error) {
	if err := checkAssertionURL(f.api); err != nil {
		return 0, err
	}
	tok, err := f.bearer()
	if err != nil {
		return 0, err
	}
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return 0, err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, strings.TrimSuffix(f.api, "/")+path, rd)
	if err != nil {
		return 0, err
	}
	req.Header.Set("Authorization", "Bearer "+tok)
	req.Header.Set("Content-Type", "application/json")
	if f.hc == nil {
		if f.hc, err = f.g.httpClient.client(f.g.logger(), 30*time.Second); err != nil {
			return 0, err
		}
		// The request carries the staff's assertion, which a redirect
		// would send on, in clear or to another host.
		f.hc.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	}
	resp, err := f.hc.Do(req)
	if err != nil {
		return 0, fmt.Errorf("%s %s: %w", method, path, err)
	}
	defer resp.Body.Close()
	const maxAnswer = 4 << 20
	raw, err := io.ReadAll(io.LimitReader(resp.Body, maxAnswer+1))
	if err != nil {
		return resp.StatusCode, err
	}
	if len(raw) > maxAnswer && resp.StatusCode < 300 {
		return resp.StatusCode, fmt.Errorf("%s %s: the answer is larger than %d MiB, more than this command reads", method, path, maxAnswer>>20)
	}
	if resp.StatusCode >= 300 {
		var e struct {
			Error struct{ Code, Message, Pointer string } `json:"error"`
		}
		if json.Unmarshal(raw, &e) != nil || e.Error.Code == "" {
			// Not the API's answer (a proxy's page, say): named as
			// the agents' client names it.
			e.Error.Code, e.Error.Message = "unexpected_answer", http.StatusText(resp.StatusCode)
		}
		return resp.StatusCode, fmt.Errorf("%s %s: %w", method, path, &httpapi.APIError{Status: resp.StatusCode, Code: e.Error.Code, Message: e.Error.Message, Pointer: e.Error.Pointer})
	}
	return resp.StatusCode, json.Unmarshal(raw, into)
}

// approvalView is what the CLI reads of an approval.
type approvalView struct {
	ID            string    `json:"id"`
	TenantID      string    `json:"tenant_id"`
	Tool          string    `json:"tool"`
	State         string    `json:"state"`
	CallStatus    string    `json:"call_status"`
	CallReason    string    `json:"call_reason"`
	ArgumentsHash string    `json:"arguments_hash"`
	ExpiresAt     time.Time `json:"expires_at"`
	Requester     struct {
		User       string   `json:"user"`
		Agent      string   `json:"agent"`
		Roles      []string `json:"roles"`
		RolesGiven bool     `json:"roles_given"`
	} `json:"requester"`
	Preview struct {
		Amount   string `json:"amount"`
		Resource string `json:"resource"`
	} `json:"preview"`
}

// approvalsTable writes approvals as a table, as of now. The resource and
// the requester come from an agent's call: a value with a newline, a tab
// or a terminal escape must not forge a row or repaint the approver's
// terminal, so the cells go through report.Table.
func approvalsTable(w io.Writer, as []approvalView, now time.Time) error {
	rows := [][]string{{"ID", "TOOL", "REQUESTER", "RESOURCE", "AMOUNT", "EXPIRES IN", "STATE"}}
	for _, a := range as {
		who := a.Requester.User + " (" + a.Requester.Agent + ")"
		if a.Requester.RolesGiven {
			// The roles the policies decided the call with.
			who += " roles: " + cmp.Or(strings.Join(a.Requester.Roles, ","), "none")
		}
		// Only a pending approval expires: a decided one's deadline
		// passed or not, nothing comes of it.
		expires := "-"
		if a.State == "pending" {
			expires = a.ExpiresAt.Sub(now).Round(time.Second).String()
		}
		rows = append(rows, []string{a.ID, a.Tool, who, a.Preview.Resource, a.Preview.Amount, expires, approvalState(a)})
	}
	return report.Table(w, rows)
}

// approvalState is a's state, and for an approved call where the call
// stands: "approved (call denied: approval_expired)".
func approvalState(a approvalView) string {
	if a.State != "approved" || a.CallStatus == "" {
		return a.State
	}
	call := "call " + a.CallStatus
	if a.CallReason != "" {
		call += ": " + a.CallReason
	}
	return a.State + " (" + call + ")"
}

func newApprovalsCmd(g *globals) *cobra.Command {
	f := staffFlags{g: g}
	cmd := &cobra.Command{Use: "approvals", Short: "List, inspect, approve and reject calls waiting for a human"}
	f.register(cmd)
	// The JSON printed holds an agent's arguments (printJSONTo escapes
	// what a terminal would not show as it is).
	printJSON := func(cmd *cobra.Command, v any) error { return printJSONTo(cmd.OutOrStdout(), v) }
	var state string
	list := &cobra.Command{
		Use:   "list",
		Short: "List the approver's tenant's approvals (pending by default)",
		RunE: func(cmd *cobra.Command, _ []string) error {
			var raw json.RawMessage
			if err := f.call(cmd.Context(), http.MethodGet, "/v1/approvals?state="+url.QueryEscape(state), nil, &raw); err != nil {
				return err
			}
			if f.jsonOut {
				return printJSON(cmd, raw)
			}
			var as []approvalView
			var more bool
			if err := json.Unmarshal(raw, &as); err != nil {
				var wrapped struct {
					Approvals []approvalView `json:"approvals"`
					More      bool           `json:"more"`
				}
				if err := json.Unmarshal(raw, &wrapped); err != nil {
					return err
				}
				as, more = wrapped.Approvals, wrapped.More
			}
			if err := approvalsTable(cmd.OutOrStdout(), as, time.Now()); err != nil {
				return err
			}
			if more {
				fmt.Fprintf(cmd.ErrOrStderr(), "warning: listed %d approvals, where the service stops: more are %s (the oldest pending are first, the newest decided)\n", len(as), cmp.Or(state, "pending"))
			}
			return nil
		},
	}
	list.Flags().StringVar(&state, "state", "pending", "pending (oldest first), rejected or expired (newest first)")
	show := &cobra.Command{
		Use:   "show ID",
		Short: "Show an approval with its readable preview",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var raw json.RawMessage
			if err := f.call(cmd.Context(), http.MethodGet, "/v1/approvals/"+url.PathEscape(args[0]), nil, &raw); err != nil {
				return err
			}
			return printJSON(cmd, raw)
		},
	}
	var hash string
	approve := &cobra.Command{
		Use:   "approve ID",
		Short: "Approve a pending call: binds the approval to the arguments hash shown by show",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			h := hash
			if h == "" {
				// Approving the hash the approval shows now, unseen,
				// would bind nothing the approver read: show it, and
				// ask for the hash back.
				var raw json.RawMessage
				if err := f.call(cmd.Context(), http.MethodGet, "/v1/approvals/"+url.PathEscape(args[0]), nil, &raw); err != nil {
					return err
				}
				var a approvalView
				if err := json.Unmarshal(raw, &a); err != nil {
					return err
				}
				if err := printJSON(cmd, raw); err != nil {
					return err
				}
				if a.State != "pending" {
					return fmt.Errorf("approvals approve: %s is %s, not pending: there is nothing to approve", args[0], a.State)
				}
				return fmt.Errorf("approvals approve: no --hash: an approval binds the arguments its approver read; read them above, then run again with --hash %s", a.ArgumentsHash)
			}
			var out json.RawMessage
			if err := f.call(cmd.Context(), http.MethodPost, "/v1/approvals/"+url.PathEscape(args[0])+"/approve", map[string]string{"arguments_hash": h}, &out); err != nil {
				return err
			}
			if f.jsonOut {
				return printJSON(cmd, out)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "approved %s (arguments %s)\n", args[0], h)
			return nil
		},
	}
	approve.Flags().StringVar(&hash, "hash", "", "the arguments hash being approved, as show prints it (required: without it, approve prints the approval and approves nothing). Never read from the environment: a LEDGER_HASH left from one approval would approve another call of the same arguments unseen")
	markExplicitOnly(approve.Flags(), "hash")
	var reason string
	reject := &cobra.Command{
		Use:   "reject ID",
		Short: "Reject a pending call, with a reason",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if reason == "" {
				return fmt.Errorf("--reason is required")
			}
			var out json.RawMessage
			if err := f.call(cmd.Context(), http.MethodPost, "/v1/approvals/"+url.PathEscape(args[0])+"/reject", map[string]string{"reason": reason}, &out); err != nil {
				return err
			}
			if f.jsonOut {
				return printJSON(cmd, out)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "rejected %s\n", args[0])
			return nil
		},
	}
	reject.Flags().StringVar(&reason, "reason", "", "why (recorded on the rejected event)")
	markExplicitOnly(reject.Flags(), "reason")
	cmd.AddCommand(list, show, approve, reject, newApprovalsServeCmd(g))
	return cmd
}

// timerCheck is the /readyz check of an approval queue's timer: its
// last round worked (approvals.Service.TimerErr).
func timerCheck(queue *approvals.Service) readyCheck {
	return readyCheck{"approvals_timer", func(context.Context) error {
		if err := queue.TimerErr(); err != nil {
			return fmt.Errorf("the last round looking for lapsed approvals failed: %w", err)
		}
		return nil
	}}
}

// newApprovalsServeCmd runs the approval queue as its own role: its HTTP
// API and its expiry timer.
func newApprovalsServeCmd(g *globals) *cobra.Command {
	var (
		rf        roleFlags
		idf       identityFlags
		httpAddr  string
		every     time.Duration
		toolsBase string
	)
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run the approval queue: its HTTP API (/v1/approvals) and the timer that expires lapsed approvals (needs --crdb-dsn)",
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			logger := g.logger()
			if err := rf.checkOps(); err != nil {
				return err
			}
			if rf.store.crdbDSN == "" {
				return errors.New("approvals serve needs --crdb-dsn: it shares the execution store with the intake and executors")
			}
			if err := rf.checkControls(); err != nil {
				return err
			}
			staff, err := idf.verifier(ctx, logger)
			if err != nil {
				return err
			}
			reg, err := rf.registry.load(logger)
			if err != nil {
				return err
			}
			m := metrics.New("approvals", reg.Has)
			rf.store.retried = m.StoreRetried
			st, desc, err := rf.store.openStore(ctx, logger)
			if err != nil {
				return err
			}
			defer st.Close()
			events, err := newEventPublisher(g.kafka.client(logger))
			if err != nil {
				return err
			}
			defer events.Close()
			// The kill switch: no resource version is read at a frozen
			// tool.
			controls, err := startControls(ctx, g.kafka.client(logger), g.kafka.topics().Control, logger)
			if err != nil {
				return err
			}
			queue, err := approvals.New(approvals.Config{
				Store: st, Registry: reg, Identity: staff, Publisher: events, Topics: g.kafka.topics(),
				Versions: httptool.New(httptool.Config{}), BaseURL: toolsBase, Freezes: controls, ControlMaxStaleness: rf.maxStaleness(),
				Actor: "approvals/" + rf.instance, Metrics: m, Logger: logger.With("component", "approvals"),
			})
			if err != nil {
				return err
			}
			m.ApprovalQueue(queue.Pending)
			m.ControlStaleness(controls.Staleness)
			if rf.metricsAddr != "" {
				// Ready while the store answers and the timer's last
				// round worked: without them nothing is served. Not
				// gated on Kafka, nor on the copy of the control topic
				// (its staleness is a series): with Kafka down,
				// approvers still see and decide approvals, whose
				// events the executors' unlogged sweep appends once it
				// is back, and a stale copy refuses only the approvals
				// that would read a resource's version. The one
				// instance out of its Service would leave approvers
				// nothing, and approvals lapse.
				checks := processChecks(nil, nil, nil, st, timerCheck(queue))
				ops, err := listenOps(g, rf.metricsAddr, "approvals", opsMux(m, checks, rf.pprof, logger), logger)
				if err != nil {
					return err
				}
				defer ops.stop()
			}
			// Stopping, the decisions in progress get the servers' grace
			// to be written and published, and the timer its round,
			// before the store and the publisher close (deferred above).
			// Before, the server was closed at once and the command
			// returned, cutting a decision between its write and its
			// publish, for the unlogged sweep to append 10 s or more
			// later.
			grp, ctx := errgroup.WithContext(ctx)
			if _, err := g.serve(ctx, grp, "approvals", httpAddr, queue.Handler()); err != nil {
				return err
			}
			grp.Go(func() error { return queue.RunTimer(ctx, every) })
			logger.Info("approval queue starting", "http_addr", httpAddr, "store", desc, "instance", rf.instance)
			return grp.Wait()
		},
	}
	rf.register(cmd, false)
	rf.registerOps(cmd, "the store answers and the last round of the timer worked; not Kafka, without which approvals are still decided")
	rf.registerControls(cmd, "an approval that would read its resource's version at the tool is answered 503 control_state_stale, to be tried again, since a freeze of the tool made since may not be read yet (a frozen tool's is refused 409 tool_frozen)", false)
	idf.registerStaff(cmd.Flags())
	cmd.Flags().StringVar(&httpAddr, "http-addr", "127.0.0.1:8090", "where the approval queue's HTTP API listens")
	cmd.Flags().DurationVar(&every, "timer-every", time.Second, "how often lapsed approvals are looked for")
	cmd.Flags().StringVar(&toolsBase, "tools-base-url", "http://127.0.0.1:8081", "base URL that relative resource version URLs resolve against")
	return cmd
}
