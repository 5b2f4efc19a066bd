use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    kuryr_binder::run(kuryr_binder::Config::parse()).await
}
