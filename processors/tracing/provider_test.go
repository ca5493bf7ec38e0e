package tracing

import (
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	coltrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"
)

// collector is an OTLP/HTTP traces receiver: it decodes what the exporter
// posts, as a collector would.
type collector struct {
	mu    sync.Mutex
	reqs  []*coltrace.ExportTraceServiceRequest
	paths []string
}

func (c *collector) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	var req coltrace.ExportTraceServiceRequest
	if err := proto.Unmarshal(b, &req); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	c.mu.Lock()
	c.reqs = append(c.reqs, &req)
	c.paths = append(c.paths, r.URL.Path)
	c.mu.Unlock()
	w.Header().Set("Content-Type", "application/x-protobuf")
	out, _ := proto.Marshal(&coltrace.ExportTraceServiceResponse{})
	_, _ = w.Write(out)
}

// TestProviderExportsOverOTLP starts a call's span through a provider
// pointed at an OTLP/HTTP receiver and checks what arrives there: the
// span, in the agent's trace, from the named service.
func TestProviderExportsOverOTLP(t *testing.T) {
	col := &collector{}
	srv := httptest.NewServer(col)
	defer srv.Close()
	p, err := NewProvider(t.Context(), Config{URL: srv.URL + "/v1/traces", Service: "toolcall-ledger-executor", Instance: "executor-0"})
	if err != nil {
		t.Fatal(err)
	}
	const trace = "4bf92f3577b34da6a3ce929d0e0e4736"
	_, span := StartCall(t.Context(), p.Tracer(), "ledger.execute", trace, "t_a/k1")
	span.End()
	if err := p.Shutdown(t.Context()); err != nil {
		t.Fatalf("shutdown (flush to the collector): %v", err)
	}
	col.mu.Lock()
	defer col.mu.Unlock()
	var found bool
	for i, req := range col.reqs {
		if col.paths[i] != "/v1/traces" {
			t.Errorf("posted to %s; want /v1/traces", col.paths[i])
		}
		for _, rs := range req.ResourceSpans {
			var service string
			for _, a := range rs.GetResource().GetAttributes() {
				if a.Key == "service.name" {
					service = a.GetValue().GetStringValue()
				}
			}
			for _, ss := range rs.ScopeSpans {
				for _, s := range ss.Spans {
					if s.Name != "ledger.execute" {
						continue
					}
					found = true
					want := TraceID(trace, "")
					if want.String() != trace {
						t.Fatalf("TraceID(%q) = %s", trace, want)
					}
					if string(s.TraceId) != string(want[:]) {
						t.Errorf("exported span in trace %x; want %s", s.TraceId, trace)
					}
					if service != "toolcall-ledger-executor" {
						t.Errorf("service.name %q; want toolcall-ledger-executor", service)
					}
				}
			}
		}
	}
	if !found {
		t.Errorf("collector got %d requests and no ledger.execute span", len(col.reqs))
	}
}

func TestNewProviderRefusesBadURLs(t *testing.T) {
	for _, u := range []string{"", "otel-collector:4318", "ftp://x/v1/traces"} {
		if _, err := NewProvider(t.Context(), Config{URL: u}); err == nil {
			t.Errorf("NewProvider(%q): no error", u)
		}
	}
}
