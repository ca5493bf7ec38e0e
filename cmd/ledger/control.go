package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"time"

	"github.com/spf13/cobra"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/token"
	"github.com/toolcall-ledger/ledger/processors/control"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/processors/policy"
	"github.com/toolcall-ledger/ledger/projections/report"
)

func newControlCmd(g *globals) *cobra.Command {
	f := staffFlags{g: g}
	cmd := &cobra.Command{
		Use:   "control",
		Short: "The kill switch: freeze and unfreeze tools, revoke credentials (as an operator, through the HTTP API)",
	}
	f.register(cmd)
	printJSON := func(cmd *cobra.Command, raw json.RawMessage) error { return printJSONTo(cmd.OutOrStdout(), raw) }
	var tool, tenant, reason, jti, family string
	action := func(use, short, path string, body func() map[string]any) *cobra.Command {
		c := &cobra.Command{
			Use:   use,
			Short: short,
			RunE: func(cmd *cobra.Command, _ []string) error {
				if reason == "" {
					return fmt.Errorf("--reason is required: every control action says why")
				}
				var out json.RawMessage
				status, err := f.callStatus(cmd.Context(), http.MethodPost, path, body(), &out)
				if err != nil {
					return err
				}
				if status == http.StatusAccepted {
					// Durable on the control topic, which every instance
					// applies; the answering service had not within its
					// wait. Not to be taken for in force yet.
					fmt.Fprintln(cmd.ErrOrStderr(), "published on the control topic, but the control service had not applied it yet (202): see ledger control show for what is in force (an action that raced another, written meanwhile through another instance, is passed over)")
				}
				sayScope(cmd.ErrOrStderr(), out)
				return printJSON(cmd, out)
			},
		}
		c.Flags().StringVar(&reason, "reason", "", "why (recorded with the action)")
		// An operator's own words for this action: a LEDGER_REASON left
		// in the environment would give every action the same.
		markExplicitOnly(c.Flags(), "reason")
		return c
	}
	toolBody := func() map[string]any { return map[string]any{"tool": tool, "tenant": tenant, "reason": reason} }
	var unknownTool bool
	freeze := action("freeze", "Freeze a tool: calls not yet started are denied tool_frozen within a second", "/v1/control/freeze", func() map[string]any {
		body := toolBody()
		if unknownTool {
			// Only when set: a control server of an older build
			// refuses the field.
			body["allow_unknown_tool"] = true
		}
		return body
	})
	freeze.Flags().BoolVar(&unknownTool, "unknown-tool", false, "freeze a tool the control service's registry does not hold (one only newer executors know); without it such a freeze is refused unknown_tool, for a mistyped name would freeze nothing")
	var freezeAt string
	unfreeze := action("unfreeze", "Lift a freeze", "/v1/control/unfreeze", func() map[string]any {
		body := toolBody()
		if freezeAt != "" {
			body["freeze_at"] = freezeAt
		}
		return body
	})
	unfreeze.Flags().StringVar(&freezeAt, "freeze-at", "", "the time (at, copied exactly from control show, to the nanosecond) of the freeze you mean to lift: refused (freeze_changed) if another freeze is in force, frozen again since you looked")
	unfreeze.PreRunE = func(*cobra.Command, []string) error {
		if freezeAt == "" {
			return nil
		}
		if _, err := time.Parse(time.RFC3339Nano, freezeAt); err != nil {
			return fmt.Errorf("--freeze-at %q: want a time as control show prints it (RFC 3339): %v", freezeAt, err)
		}
		return nil
	}
	for _, c := range []*cobra.Command{freeze, unfreeze} {
		c.Flags().StringVar(&tool, "tool", "", "the tool")
		c.Flags().StringVar(&tenant, "for-tenant", "", "only this tenant (default: all, for a platform operator; the operator's own tenant otherwise)")
	}
	revoke := action("revoke", "Revoke a credential (--jti) or a credential family (--family): tools refuse it at once", "/v1/control/revoke", func() map[string]any {
		return map[string]any{"jti": jti, "family": family, "reason": reason}
	})
	revoke.Flags().StringVar(&jti, "jti", "", "one credential's id: a call keeps its jti over all its executions, so this stops every credential of that call, for good (a call taken over is then not sent again: outcome_unknown, for the reconciler); a platform operator's alone (--tenant '*'): a tenant's operator revokes the family")
	revoke.Flags().StringVar(&family, "family", "", "a credential family (<tool>:<tenant>:<key epoch>, as on the events)")
	show := &cobra.Command{
		Use:   "show",
		Short: "Show the current freezes, revocations and policy activation",
		RunE: func(cmd *cobra.Command, _ []string) error {
			var out json.RawMessage
			if err := f.call(cmd.Context(), http.MethodGet, "/v1/control", nil, &out); err != nil {
				return err
			}
			return printJSON(cmd, out)
		},
	}
	var label, hash, pinFrom string
	activate := action("activate-policy", "Make a policy version (a label under each instance's --policy-versions-dir) the one every intake and executor decides with", "/v1/control/activate-policy", func() map[string]any {
		body := map[string]any{"policy": label, "reason": reason}
		if hash != "" {
			// Only when set: a control server of an older build
			// refuses the field, and should refuse a pin it ignores.
			body["policy_hash"] = hash
		}
		return body
	})
	activate.Flags().StringVar(&label, "policy", "", "the version's label")
	activate.Flags().StringVar(&hash, "policy-hash", "", "pin the version's content: the policy set's hash (sha256: and 64 hex digits, as --pin-from computes it); an instance whose files under the label hash otherwise denies every call until they match. Empty: the label alone, each instance deciding with whatever its files say")
	activate.Flags().StringVar(&pinFrom, "pin-from", "", "a policy versions directory here (the copy you reviewed): pins the content of <dir>/<label>/*.cedar, sending its hash as --policy-hash")
	activate.PreRunE = func(*cobra.Command, []string) error {
		if pinFrom == "" {
			return nil
		}
		if label == "" {
			return fmt.Errorf("--pin-from needs --policy, the label whose files to pin")
		}
		dir := filepath.Join(pinFrom, label)
		set, err := policy.LoadDir(dir, label)
		if err != nil {
			return fmt.Errorf("--pin-from: %s: %w", dir, err)
		}
		if hash != "" && hash != set.Hash() {
			return fmt.Errorf("--policy-hash %s: %s hashes to %s", hash, dir, set.Hash())
		}
		hash = set.Hash()
		return nil
	}
	withdraw := action("withdraw-policy", "End the policy activation in force: every intake and executor decides with its --policy-dir again (control show says which version is activated)", "/v1/control/withdraw-policy", func() map[string]any {
		return map[string]any{"reason": reason}
	})
	cmd.AddCommand(freeze, unfreeze, revoke, activate, withdraw, show)
	return cmd
}

// sayScope writes, for a freeze or an unfreeze, which tenants it is of,
// as the service decided it: the action's JSON says so only by a tenant
// field left out for every tenant's.
func sayScope(w io.Writer, raw json.RawMessage) {
	var a ledger.ControlAction
	if json.Unmarshal(raw, &a) != nil || (a.Kind != "freeze" && a.Kind != "unfreeze") {
		return
	}
	scope := "every tenant"
	if a.Tenant != "" {
		scope = "tenant " + a.Tenant
	}
	fmt.Fprintf(w, "%s of %s for %s\n", a.Kind, report.Printable(a.Tool), report.Printable(scope))
}

// callTenantHelp is the help of the calls commands' --call-tenant.
const callTenantHelp = "the call's tenant, KEY being the key alone (default: KEY read as <tenant_id>/<idempotency_key> when it holds a \"/\", else the tenant of the operator's assertion, t_demo for a platform operator's)"

// callKey is the call a calls command acts on: KEY arg, of the tenant
// flag named flag (tenant) when given (or its variable); else, for a
// tenant operator, who acts on its own tenant alone, arg read as
// <tenant_id>/<idempotency_key> when it names that tenant, and as a key of
// it otherwise (a key may hold a "/"); for a platform operator, arg read
// so, or a key of t_demo. Before, the tenant was t_demo unless
// --call-tenant said otherwise, whoever acted.
func (f *staffFlags) callKey(cmd *cobra.Command, flag, tenant, arg string) ledger.CallKey {
	if flagGiven(cmd.Flags(), flag) {
		return ledger.CallKey{TenantID: tenant, IdempotencyKey: arg}
	}
	own := f.tenant
	if f.assertion != "" {
		var c identity.Claims
		if token.Unverified(f.assertion, &c) == nil {
			own = c.Tenant
		}
	}
	k, err := ledger.ParseCallKey(arg)
	switch {
	case own != "" && own != control.PlatformTenant && (err != nil || k.TenantID != own):
		return ledger.CallKey{TenantID: own, IdempotencyKey: arg}
	case err == nil:
		return k
	default:
		return ledger.CallKey{TenantID: "t_demo", IdempotencyKey: arg}
	}
}

func newCallsCmd(g *globals) *cobra.Command {
	f := staffFlags{g: g}
	cmd := &cobra.Command{Use: "calls", Short: "Operate on calls (as an operator, through the HTTP API)"}
	f.register(cmd)
	var as, evidence, tenant string
	var cancelCompensation bool
	resolve := &cobra.Command{
		Use:   "resolve KEY",
		Short: "Settle a call whose outcome is unknown, with the evidence of what happened (KEY: <tenant_id>/<idempotency_key>, or a key of --call-tenant)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if evidence == "" {
				return fmt.Errorf("--evidence is required: say how you know")
			}
			key := f.callKey(cmd, "call-tenant", tenant, args[0])
			var out json.RawMessage
			body := map[string]any{"tenant_id": key.TenantID, "idempotency_key": key.IdempotencyKey, "as": as, "evidence": evidence, "cancel_compensation": cancelCompensation}
			if err := f.call(cmd.Context(), http.MethodPost, "/v1/resolutions", body, &out); err != nil {
				return err
			}
			return printJSONTo(cmd.OutOrStdout(), out)
		},
	}
	resolve.Flags().StringVar(&as, "as", "", "succeeded or failed")
	resolve.Flags().StringVar(&evidence, "evidence", "", "how you found out (recorded on the event)")
	resolve.Flags().StringVar(&tenant, "call-tenant", "", callTenantHelp)
	resolve.Flags().BoolVar(&cancelCompensation, "cancel-compensation", false, "with --as succeeded, while the compensation the reconciler asked for (a policy's undo_unknown) is still to run: confirm that it is to end without undoing the call (nothing_to_undo), an operator's request to undo the call that joined it with it; without, such a resolution is refused (automatic_compensation_pending), as it is, confirmed or not, while an executor runs that compensation. Never read from the environment")
	// The decision and its evidence are the operator's, for this call:
	// never read from the environment.
	markExplicitOnly(resolve.Flags(), "cancel-compensation", "as", "evidence")
	var reason, compTenant string
	compensate := &cobra.Command{
		Use:   "compensate KEY",
		Short: "Undo a succeeded call: its tool's declared compensation runs as a governed call of its own (<KEY>:compensate; KEY: <tenant_id>/<idempotency_key>, or a key of --call-tenant)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if reason == "" {
				return fmt.Errorf("--reason is required")
			}
			key := f.callKey(cmd, "call-tenant", compTenant, args[0])
			var raw json.RawMessage
			body := map[string]string{"tenant_id": key.TenantID, "idempotency_key": key.IdempotencyKey, "reason": reason}
			if err := f.call(cmd.Context(), http.MethodPost, "/v1/compensations", body, &raw); err != nil {
				return err
			}
			var out struct {
				CompensationKey string         `json:"compensation_key"`
				Events          []ledger.Event `json:"events"`
			}
			if err := json.Unmarshal(raw, &out); err != nil {
				return fmt.Errorf("the compensation's answer: %w", err)
			}
			// Answered, and refused (the tool frozen, the policies, a
			// rate limit): nothing will undo the call.
			ev, refused := ledger.Refusing(out.Events)
			if f.jsonOut {
				if err := printJSONTo(cmd.OutOrStdout(), raw); err != nil {
					return err
				}
			} else if !refused {
				fmt.Fprintf(cmd.OutOrStdout(), "compensation requested: %s\n", out.CompensationKey)
			}
			if refused {
				return fmt.Errorf("compensation %s refused: %s", out.CompensationKey, ledger.RefusalText(ev))
			}
			return nil
		},
	}
	compensate.Flags().StringVar(&reason, "reason", "", "why (recorded on the compensation's requested event, with who asked)")
	markExplicitOnly(compensate.Flags(), "reason")
	compensate.Flags().StringVar(&compTenant, "call-tenant", "", callTenantHelp)
	cmd.AddCommand(resolve, compensate)
	return cmd
}
