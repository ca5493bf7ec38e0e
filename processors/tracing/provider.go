package tracing

import (
	"context"
	"errors"
	"fmt"
	"net/url"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// Config configures NewProvider.
type Config struct {
	// URL is the OTLP/HTTP traces endpoint, e.g.
	// http://otel-collector:4318/v1/traces. Required.
	URL string
	// Service names the process in the traces (service.name), e.g.
	// "toolcall-ledger-executor"; Instance is its service.instance.id.
	Service, Instance string
	// Exporter replaces the OTLP exporter (tests use an in-memory one).
	Exporter sdktrace.SpanExporter
}

// Provider exports a process's spans. Shutdown flushes what is batched.
type Provider struct {
	tp *sdktrace.TracerProvider
}

// NewProvider returns a provider that batches spans to the OTLP endpoint,
// with IDGenerator so that calls' spans land in the agents' traces. It
// connects lazily: an unreachable collector loses spans (and the SDK logs
// it), never calls.
func NewProvider(ctx context.Context, cfg Config) (*Provider, error) {
	exp := cfg.Exporter
	if exp == nil {
		if cfg.URL == "" {
			return nil, errors.New("tracing: no OTLP endpoint URL")
		}
		u, err := url.Parse(cfg.URL)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return nil, fmt.Errorf("tracing: %q is not an http(s) OTLP traces URL", cfg.URL)
		}
		exp, err = otlptracehttp.New(ctx, otlptracehttp.WithEndpointURL(cfg.URL))
		if err != nil {
			return nil, fmt.Errorf("tracing: OTLP exporter: %w", err)
		}
	}
	attrs := []attribute.KeyValue{attribute.String("service.name", cfg.Service)}
	if cfg.Instance != "" {
		attrs = append(attrs, attribute.String("service.instance.id", cfg.Instance))
	}
	tp := sdktrace.NewTracerProvider(
		sdktrace.WithBatcher(exp),
		sdktrace.WithIDGenerator(IDGenerator{}),
		sdktrace.WithResource(resource.NewSchemaless(attrs...)),
	)
	return &Provider{tp: tp}, nil
}

// Tracer is the tracer the ledger's processors start spans with.
func (p *Provider) Tracer() trace.Tracer {
	return p.tp.Tracer("github.com/toolcall-ledger/ledger")
}

// ForceFlush exports what is batched now.
func (p *Provider) ForceFlush(ctx context.Context) error {
	return p.tp.ForceFlush(ctx)
}

// Shutdown exports what is batched and stops.
func (p *Provider) Shutdown(ctx context.Context) error {
	return p.tp.Shutdown(ctx)
}
