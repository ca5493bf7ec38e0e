package demobackend

import (
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
)

// Tool names served by the backend.
const (
	ToolGetWeather   = "get_weather"
	ToolCreateTicket = "create_ticket"
	ToolRefundOrder  = "refund_order"
	ToolSendEmail    = "send_email"
	// ToolCancelRefund undoes a refund_order: its compensation.
	ToolCancelRefund = "cancel_refund"
)

// statusSuffix names the status lookup of a tool in SetFault:
// SetFault("refund_order/status", f) faults the lookup, not the tool.
const statusSuffix = "/status"

// toolKind is how a tool treats a repeated idempotency key.
type toolKind int

const (
	// kindRead: no side effect; every request is recorded as a read.
	kindRead toolKind = iota + 1
	// kindNative: the first request with a (tenant, key) applies the effect,
	// later ones replay its answer.
	kindNative
	// kindNone: every request applies the effect, whatever the key, so a
	// duplicate delivery is a visible duplicate effect.
	kindNone
)

// tool is one route's behaviour. parse validates the arguments (minimally:
// the ledger validates them against the tool's schema before they get here)
// and returns the function that builds the answer from the effect's number.
type tool struct {
	name  string
	kind  toolKind
	parse func(body []byte) (build func(n int64) any, err error)
}

func toolNamed(name string) (tool, bool) {
	switch name {
	case ToolGetWeather:
		return tool{name: name, kind: kindRead, parse: parseWeather}, true
	case ToolCreateTicket:
		return tool{name: name, kind: kindNative, parse: parseTicket}, true
	case ToolRefundOrder:
		return tool{name: name, kind: kindNative, parse: parseRefund}, true
	case ToolSendEmail:
		return tool{name: name, kind: kindNone, parse: parseEmail}, true
	case ToolCancelRefund:
		return tool{name: name, kind: kindNative, parse: parseCancelRefund}, true
	}
	return tool{}, false
}

// object decodes body as a JSON object into v. Unknown fields are accepted:
// strictness is the ledger's job, and a demo tool that rejected a field the
// registry allows would only get in the way.
func object(body []byte, v any) error {
	if !strings.HasPrefix(strings.TrimSpace(string(body)), "{") {
		return errors.New("the arguments must be a JSON object")
	}
	if err := json.Unmarshal(body, v); err != nil {
		return fmt.Errorf("arguments: %v", err)
	}
	return nil
}

// Weather is get_weather's answer.
type Weather struct {
	City        string `json:"city"`
	Unit        string `json:"unit"`
	Temperature int    `json:"temperature"`
	Conditions  string `json:"conditions"`
}

func parseWeather(body []byte) (func(int64) any, error) {
	var args struct {
		City string `json:"city"`
		Unit string `json:"unit"`
	}
	if err := object(body, &args); err != nil {
		return nil, err
	}
	if args.City == "" {
		return nil, errors.New("city is required")
	}
	switch args.Unit {
	case "":
		args.Unit = "celsius"
	case "celsius", "fahrenheit":
	default:
		return nil, errors.New(`unit must be "celsius" or "fahrenheit"`)
	}
	// Deterministic: the same city always has the same weather, so tests
	// can compare answers across calls and processes.
	conditions := [...]string{"sunny", "cloudy", "rain", "wind", "fog", "snow"}
	h := sha256.Sum256([]byte(strings.ToLower(args.City)))
	temp := int(h[0])%40 - 5
	if args.Unit == "fahrenheit" {
		temp = temp*9/5 + 32
	}
	w := Weather{City: args.City, Unit: args.Unit, Temperature: temp, Conditions: conditions[int(h[1])%len(conditions)]}
	return func(int64) any { return w }, nil
}

// Ticket is create_ticket's answer.
type Ticket struct {
	TicketID string `json:"ticket_id"`
	Title    string `json:"title,omitempty"`
	State    string `json:"state"`
}

func parseTicket(body []byte) (func(int64) any, error) {
	var args struct {
		Title string `json:"title"`
	}
	if err := object(body, &args); err != nil {
		return nil, err
	}
	return func(n int64) any {
		return Ticket{TicketID: fmt.Sprintf("tkt_%d", n), Title: args.Title, State: "open"}
	}, nil
}

// Refund is refund_order's answer.
type Refund struct {
	RefundID    string `json:"refund_id"`
	OrderID     string `json:"order_id"`
	AmountCents int64  `json:"amount_cents"`
	Currency    string `json:"currency"`
	State       string `json:"state"`
}

func parseRefund(body []byte) (func(int64) any, error) {
	var args struct {
		OrderID     string `json:"order_id"`
		AmountCents int64  `json:"amount_cents"`
		Currency    string `json:"currency"`
	}
	if err := object(body, &args); err != nil {
		return nil, err
	}
	if args.OrderID == "" {
		return nil, errors.New("order_id is required")
	}
	return func(n int64) any {
		return Refund{
			RefundID:    fmt.Sprintf("rf_%d", n),
			OrderID:     args.OrderID,
			AmountCents: args.AmountCents,
			Currency:    args.Currency,
			State:       "refunded",
		}
	}, nil
}

// parseCancelRefund takes the refund's own arguments and answers with the
// refund marked cancelled.
func parseCancelRefund(body []byte) (func(int64) any, error) {
	build, err := parseRefund(body)
	if err != nil {
		return nil, err
	}
	return func(n int64) any {
		r := build(n).(Refund)
		r.RefundID = fmt.Sprintf("cr_%d", n)
		r.State = "cancelled"
		return r
	}, nil
}

// Email is send_email's answer.
type Email struct {
	MessageID string `json:"message_id"`
}

func parseEmail(body []byte) (func(int64) any, error) {
	var args map[string]json.RawMessage
	if err := object(body, &args); err != nil {
		return nil, err
	}
	return func(n int64) any { return Email{MessageID: fmt.Sprintf("msg_%d", n)} }, nil
}
